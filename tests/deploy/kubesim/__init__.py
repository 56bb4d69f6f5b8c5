"""A stand-in kubelet: runs a rendered Helm chart's pods as real processes, each in its own network
namespace, and probes them the way the kubelet does (tests/deploy/test_chart_kubelet.py)."""
