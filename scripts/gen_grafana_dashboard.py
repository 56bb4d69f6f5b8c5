"""Write deploy/grafana/dashboards/minisgl.json from the panel list below (run after editing it).

Each panel is a PromQL expression over the `minisgl_` metrics; tests/e2e check that every metric named
here is exported by the running stack, so the dashboard cannot drift from the code.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "minisgl.json"

Q = "histogram_quantile({q}, sum by (le) (rate(minisgl_{m}_bucket[1m])))"
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Requests / s by status", "reqps",
     [("sum by (status) (rate(minisgl_http_requests_total[1m]))", "{{status}}")]),
    ("Running and waiting requests", "short",
     [("sum(minisgl_num_requests_running)", "running"),
      ("sum(minisgl_num_requests_waiting)", "waiting")]),
    ("Time to first token", "s",
     [(Q.format(q=q, m="time_to_first_token_seconds"), f"p{int(q * 100)}")
      for q in (0.5, 0.9, 0.99)]),
    ("Inter-token latency", "s",
     [(Q.format(q=q, m="inter_token_latency_seconds"), f"p{int(q * 100)}")
      for q in (0.5, 0.9, 0.99)]),
    ("End-to-end latency", "s",
     [(Q.format(q=q, m="e2e_request_latency_seconds"), f"p{int(q * 100)}")
      for q in (0.5, 0.9, 0.99)]),
    ("Tokens / s", "short",
     [("sum(rate(minisgl_prompt_tokens_total[1m]))", "prompt"),
      ("sum(rate(minisgl_generation_tokens_total[1m]))", "generation")]),
    ("KV cache usage", "percentunit", [("max(minisgl_kv_cache_usage_perc)", "used")]),
    ("Prefix cache hit rate", "percentunit",
     [("max(minisgl_prefix_cache_hit_rate)", "hit rate")]),
    ("Preemptions / s", "short",
     [("sum(rate(minisgl_num_preemptions_total[1m]))", "preemptions")]),
]


def build() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "prometheus"},
            "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(targets)],
        })
    return {"uid": "minisgl", "title": "minisgl", "schemaVersion": 39, "version": 1,
            "refresh": "5s", "time": {"from": "now-30m", "to": "now"}, "panels": panels,
            "templating": {"list": []}, "annotations": {"list": []}}


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {OUT}")
