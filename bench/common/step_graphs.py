"""Worker steps by how they ran, from the workers' /metrics
(`minisgl_worker_step_graph_total{graph}`: cuda_graph, piecewise or eager)."""

from __future__ import annotations

from bench.common.prefix_cache import read

NAME = "minisgl_worker_step_graph_total"


def graph_steps(text: str) -> dict[str, float]:
    """Steps by `graph` label in one /metrics page, every other label summed over."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(NAME + "{"):
            graph = line.split('graph="', 1)[1].split('"', 1)[0]
            out[graph] = out.get(graph, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def graph_steps_of(urls: list[str]) -> dict[str, float]:
    """`graph_steps` summed over several workers' /metrics."""
    total: dict[str, float] = {}
    for url in urls:
        for graph, n in graph_steps(read(url)).items():
            total[graph] = total.get(graph, 0.0) + n
    return total
