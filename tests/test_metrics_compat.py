"""vLLM compatibility names (minisgl_core.metrics_compat): one owner per name, renamed samples."""

from __future__ import annotations

from collections import Counter as Tally

import pytest
from minisgl_core import metrics_compat
from minisgl_core.metrics_compat import renamed, set_compat
from prometheus_client import CollectorRegistry, Histogram


def test_every_vllm_name_has_one_owner() -> None:
    """Gateway and scheduler declare their aliases in one process here; a name declared twice
    would be exported by two services and double every sum over it."""
    import minisgl_gateway.metrics  # noqa: F401 (declares the gateway's aliases)
    from minisgl_scheduler.metrics import SchedulerMetrics

    SchedulerMetrics.get()
    names = Tally(n for _, ns in metrics_compat._aliases for n in ns)
    assert [n for n, c in names.items() if c > 1] == []
    wanted = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:gpu_cache_usage_perc", "vllm:time_to_first_token_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
              "vllm:time_per_output_token_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
              "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
              "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
              "vllm:request_params_n", "vllm:request_params_max_tokens",
              "vllm:request_time_per_output_token_seconds", "vllm:cache_config_info",
              "vllm:request_success", "vllm:request_max_num_generation_tokens"}
    assert wanted <= names.keys(), wanted - names.keys()


def test_renamed_histogram_keeps_suffixes_labels_and_values() -> None:
    h = Histogram("minisgl_x_seconds", "x", ["model_name"], buckets=(0.1, 1.0),
                  registry=CollectorRegistry())
    h.labels("m").observe(0.5)
    [family] = h.collect()
    out = renamed(family, "vllm:x_seconds")
    samples = {(s.name, s.labels.get("le")): s.value for s in out.samples
               if s.labels.get("model_name") == "m"}
    assert samples[("vllm:x_seconds_bucket", "0.1")] == 0.0
    assert samples[("vllm:x_seconds_bucket", "1.0")] == 1.0
    assert samples[("vllm:x_seconds_count", None)] == 1.0
    assert samples[("vllm:x_seconds_sum", None)] == 0.5
    assert out.name == "vllm:x_seconds" and out.type == "histogram"


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="sglang"):
        set_compat("sglang")
