"""Timing a piece of GPU work as the engine runs it: captured once in a CUDA graph, replayed."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_replay_ms(body: Callable[[], object], repeats: int) -> float:
    """Median ms of one replay of a graph capturing body(). body runs once uncaptured first
    (Triton compiles outside the capture), and the graph once more before the timed replays.
    The warm-up is on the current stream, as in the engine's capture (cuda_graph.py): warmed on a
    side stream instead, the captured cuBLAS products of a 0.6B decode layer ran 11 % slower
    in the one run that tried it (38.4 against 34.6-34.8 µs a layer, H100;
    docs/benchmarks/log/2026-11-24-11.md)."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_us(layer_fn: Callable[[int], object], iters: int, layers: int = 28) -> float:
    """Median µs per layer call: a graph of `layers` calls (a Qwen3-0.6B's worth by default),
    each replay timed with CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for i in range(layers):
            layer_fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            layer_fn(i)
    for _ in range(3):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    del graph
    return 1000 * ms / layers
