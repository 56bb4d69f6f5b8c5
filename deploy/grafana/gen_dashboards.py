"""Write the Grafana dashboards: deploy/grafana/dashboards/*.json and the chart's copies.

    .venv/bin/python deploy/grafana/gen_dashboards.py

Three dashboards over the `minisgl_` metrics: overview (what a user sees), tiers (each service and
its gRPC calls), engine (scheduler and worker internals). Each has a `datasource` variable (no
hard-coded uid, so it imports into any Grafana) and `model_name` / `instance` variables. Tests
check that the committed JSON equals this script's output and that every query returns data from a
real Prometheus scraping a running stack (tests/e2e/test_dashboards_have_data.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUTS = [HERE / "dashboards", HERE.parents[0] / "k8s" / "minisgl" / "files" / "dashboards"]

SEL = 'model_name=~"$model_name", instance=~"$instance"'  # a request/engine series
INST = 'instance=~"$instance"'  # a per-process series without a model
RI = "$__rate_interval"


def q(quantile: float, metric: str, by: str = "le", sel: str = SEL) -> str:
    return f"histogram_quantile({quantile}, sum by ({by}) (rate({metric}_bucket{{{sel}}}[{RI}])))"


def quantiles(metric: str, sel: str = SEL) -> list[tuple[str, str]]:
    return [(q(x, "minisgl_" + metric, sel=sel), f"p{round(x * 100)}") for x in (0.5, 0.9, 0.99)]


def mean(metric: str, sel: str = SEL) -> tuple[str, str]:
    m = "minisgl_" + metric
    return (f"sum(rate({m}_sum{{{sel}}}[{RI}])) / sum(rate({m}_count{{{sel}}}[{RI}]))", "mean")


Panel = tuple[str, str, list[tuple[str, str]]]  # title, unit, [(expr, legend)]

OVERVIEW: list[Panel] = [
    ("Requests / s by HTTP status", "reqps",
     [(f"sum by (status) (rate(minisgl_http_requests_total{{{INST}}}[{RI}]))", "{{status}}")]),
    ("Error ratio (HTTP 5xx)", "percentunit",
     [(f'(sum(rate(minisgl_http_requests_total{{status=~"5..", {INST}}}[{RI}])) or vector(0))'
       f" / sum(rate(minisgl_http_requests_total{{{INST}}}[{RI}]))", "5xx")]),
    ("Running and waiting requests", "short",
     [(f"sum by (model_name) (minisgl_num_requests_running{{{SEL}}})", "running {{model_name}}"),
      (f"sum by (model_name) (minisgl_num_requests_waiting{{{SEL}}})", "waiting {{model_name}}"),
      (f"sum(minisgl_gateway_running_requests{{{INST}}})", "at the gateways")]),
    ("Time to first token", "s", quantiles("time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("inter_token_latency_seconds")),
    ("End-to-end latency", "s", [*quantiles("e2e_request_latency_seconds"),
                                 mean("e2e_request_latency_seconds")]),
    ("Tokens / s", "short",
     [(f"sum(rate(minisgl_prompt_tokens_total{{{SEL}}}[{RI}]))", "prompt"),
      (f"sum(rate(minisgl_generation_tokens_total{{{SEL}}}[{RI}]))", "generation")]),
    ("Finish reasons / s", "reqps",
     [(f"sum by (finished_reason) (rate(minisgl_request_success_total{{{SEL}}}[{RI}]))",
       "{{finished_reason}}")]),
    ("KV cache usage", "percentunit",
     [(f"max by (model_name) (minisgl_kv_cache_usage_perc{{{SEL}}})", "{{model_name}}")]),
    ("Prefix cache hit rate", "percentunit",
     [(f"sum(rate(minisgl_prefix_cache_hits_total{{{SEL}}}[{RI}])) / "
       f"sum(rate(minisgl_prefix_cache_queries_total{{{SEL}}}[{RI}]))", "hit rate")]),
]

GRPC = "minisgl_grpc_server"
TIERS: list[Panel] = [
    ("Targets up", "short", [(f"up{{{INST}}}", "{{job}} {{instance}}")]),
    ("gRPC calls / s by service and code", "reqps",
     [(f"sum by (grpc_service, grpc_code) (rate({GRPC}_handled_total{{{INST}}}[{RI}]))",
       "{{grpc_service}} {{grpc_code}}")]),
    # Methods without calls in the window are dropped (`> 0`), not drawn as NaN; a stream
    # counts when it ends (minisgl_core.grpc_metrics), so long-lived streams rarely show.
    ("gRPC mean call duration by method", "s",
     [(f"sum by (grpc_method) (rate({GRPC}_handling_seconds_sum{{{INST}}}[{RI}])) / "
       f"(sum by (grpc_method) (rate({GRPC}_handling_seconds_count{{{INST}}}[{RI}])) > 0)",
       "{{grpc_method}}")]),
    ("Public API: HTTP and gRPC requests / s", "reqps",
     [(f"sum by (endpoint) (rate(minisgl_http_requests_total{{{INST}}}[{RI}]))", "{{endpoint}}"),
      (f"sum by (method) (rate(minisgl_grpc_requests_total{{{INST}}}[{RI}])) or vector(0)",
       "gRPC {{method}}")]),
    ("Gateway: upstream streams lost / s", "short",
     [(f"sum(rate(minisgl_gateway_upstream_stream_losses_total{{{INST}}}[{RI}])) or vector(0)",
       "lost")]),
    # Engine replicas behind the gateways (docs/operations.md, "Scale-out routing"): where
    # sequences go and why (cache, room, load, round_robin, sticky, only, retry), which engines
    # take traffic, and whether the router's cache predictions hold.
    ("Gateway: routed / s by engine and reason, engines up, retries / s", "short",
     [(f"sum by (engine, reason) (rate(minisgl_gateway_routed_requests_total{{{INST}}}[{RI}]))",
       "{{engine}} {{reason}}"),
      (f"max by (engine) (minisgl_gateway_engine_up{{{INST}}})", "up {{engine}}"),
      (f"sum(rate(minisgl_gateway_retries_total{{{INST}}}[{RI}])) or vector(0)", "retries")]),
    ("Gateway: cached prompt tokens / s, predicted by routing vs reported by engines", "short",
     [(f"sum(rate(minisgl_gateway_predicted_cached_tokens_total{{{INST}}}[{RI}])) or vector(0)",
       "predicted"),
      (f"sum(rate(minisgl_gateway_reported_cached_tokens_total{{{INST}}}[{RI}])) or vector(0)",
       "reported")]),
    ("Tokenizer: items / s and tokens / s", "short",
     [(f"sum by (kind) (rate(minisgl_tokenizer_items_total{{{INST}}}[{RI}]))", "items {{kind}}"),
      (f"sum(rate(minisgl_tokenizer_prompt_tokens_total{{{SEL}}}[{RI}]))", "tokens")]),
    ("Tokenize call latency", "s", quantiles("tokenizer_request_seconds", INST)),
    ("Detokenizer: tokens / s and open streams", "short",
     [(f"sum(rate(minisgl_detokenizer_tokens_total{{{SEL}}}[{RI}]))", "tokens / s"),
      (f"sum(minisgl_detokenizer_streams{{{INST}}})", "streams")]),
    ("Detokenizer step latency", "s", quantiles("detokenizer_step_seconds", INST)),
    ("Worker steps / s and errors / s", "short",
     [(f"sum(rate(minisgl_worker_steps_total{{{SEL}}}[{RI}]))", "steps"),
      (f"sum(rate(minisgl_worker_step_errors_total{{{SEL}}}[{RI}]))", "errors")]),
]

ENGINE: list[Panel] = [
    ("Scheduler iteration duration", "s", quantiles("step_duration_seconds")),
    ("Worker step duration (launch to result)", "s", quantiles("worker_step_seconds")),
    ("Worker steps / s by how they ran (CUDA graph, piecewise graphs, eager)", "short",
     [(f"sum by (graph) (rate(minisgl_worker_step_graph_total{{{SEL}}}[{RI}]))", "{{graph}}")]),
    ("Tokens per iteration", "short", quantiles("iteration_tokens")),
    ("Request queue time", "s", [*quantiles("request_queue_time_seconds"),
                                 mean("request_queue_time_seconds")]),
    ("Request prefill and decode time (mean)", "s",
     [(mean("request_prefill_time_seconds")[0], "prefill"),
      (mean("request_decode_time_seconds")[0], "decode"),
      (mean("request_inference_time_seconds")[0], "inference")]),
    ("Time per output token (per request)", "s",
     quantiles("request_time_per_output_token_seconds")),
    ("Prompt and generation length p90", "short",
     [(q(0.9, "minisgl_request_prompt_tokens"), "prompt"),
      (q(0.9, "minisgl_request_generation_tokens"), "generation"),
      (q(0.9, "minisgl_request_params_max_tokens"), "max_tokens")]),
    ("Preemptions / s and prefill tokens computed / s", "short",
     [(f"sum(rate(minisgl_num_preemptions_total{{{SEL}}}[{RI}]))", "preemptions"),
      (f"sum(rate(minisgl_prefill_computed_tokens_total{{{SEL}}}[{RI}]))", "prefill tokens")]),
    ("Prefix cache pages", "short",
     [(f"sum by (model_name) (minisgl_prefix_cache_pages{{{SEL}}})", "{{model_name}}")]),
    ("KV cache configuration", "short",
     [(f"max by (model_name, block_size, num_gpu_blocks, cache_dtype, max_num_seqs) "
       f"(minisgl_cache_config_info{{{SEL}}})",
       "{{model_name}} {{num_gpu_blocks}} x {{block_size}} {{cache_dtype}}")]),
]

DASHBOARDS: dict[str, tuple[str, list[Panel]]] = {
    "overview": ("minisgl / overview", OVERVIEW),
    "tiers": ("minisgl / tiers", TIERS),
    "engine": ("minisgl / engine internals", ENGINE),
}

DS = {"type": "prometheus", "uid": "${datasource}"}


def _variables() -> list[dict[str, Any]]:
    def query(name: str, expr: str) -> dict[str, Any]:
        return {"name": name, "label": name, "type": "query", "datasource": DS,
                "query": {"query": expr, "refId": f"{name}-var"}, "definition": expr,
                "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
                "current": {"text": "All", "value": "$__all"}, "sort": 1}

    return [
        {"name": "datasource", "label": "datasource", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0, "refresh": 1},
        query("model_name", 'label_values({__name__=~"minisgl_.*"}, model_name)'),
        query("instance", 'label_values({__name__=~"minisgl_.*"}, instance)'),
    ]


def build(key: str) -> dict[str, Any]:
    title, spec = DASHBOARDS[key]
    panels = []
    for i, (name, unit, targets) in enumerate(spec):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": name, "datasource": DS,
            "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "datasource": DS, "expr": expr,
                         "legendFormat": legend} for j, (expr, legend) in enumerate(targets)],
        })
    links = [{"title": t, "type": "link", "url": f"/d/minisgl-{k}", "keepTime": True,
              "includeVars": True} for k, (t, _) in DASHBOARDS.items() if k != key]
    return {"uid": f"minisgl-{key}", "title": title, "tags": ["minisgl"], "schemaVersion": 39,
            "version": 1, "editable": True, "refresh": "10s", "links": links,
            "time": {"from": "now-30m", "to": "now"}, "panels": panels,
            "templating": {"list": _variables()}, "annotations": {"list": []}}


def expand(expr: str, rate_interval: str = "1m") -> str:
    """A panel query as Grafana would send it with every variable on All (for tests)."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("${datasource}", "")
    return re.sub(r"\$\{?(model_name|instance)\}?", ".*", expr)


def render() -> dict[str, str]:
    return {f"{key}.json": json.dumps(build(key), indent=2) + "\n" for key in DASHBOARDS}


if __name__ == "__main__":
    for out in OUTS:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in render().items():
            (out / name).write_text(text)
            print(f"wrote {out / name}")
