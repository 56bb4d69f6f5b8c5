"""The /metrics listener of the internal services: always Prometheus text format 0.0.4.

prometheus_client's own server answers a scraper that offers OpenMetrics (Prometheus does) in that
format, and its OpenMetrics writer turns the colon of `vllm:` sample names into `_`, which would
break the vLLM compatibility names (`minisgl_core.metrics_compat`). The text format keeps them
as they are; nothing we export needs OpenMetrics (no exemplars).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # a scrape every few seconds is not worth a log line


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def serve_text_metrics(port: int, addr: str) -> ThreadingHTTPServer:
    """Serve REGISTRY at http://addr:port/metrics from a daemon thread."""
    server = _Server((addr, port), _Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
