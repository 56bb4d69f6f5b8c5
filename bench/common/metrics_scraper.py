"""A Prometheus stand-in for benchmarks: GET every service's /metrics on an interval.

`python -m bench.serving --launch --scrape-interval 1` runs one during the load, so that the cost of
exporting metrics (the vLLM compatibility names of `--metrics-compat vllm` are built at scrape
time) is part of the measured throughput. Reports scrapes done and the mean scrape time.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass, field


@dataclass
class Scraper:
    urls: list[str]
    interval_s: float
    scrapes: int = 0
    seconds: float = 0.0
    bytes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Scraper:
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for url in self.urls:
                t0 = time.perf_counter()
                try:
                    with urllib.request.urlopen(url, timeout=10) as reply:
                        self.bytes += len(reply.read())
                except OSError:
                    continue
                self.seconds += time.perf_counter() - t0
                self.scrapes += 1

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        return {"scrapes": self.scrapes, "scrape_bytes": self.bytes,
                "mean_scrape_ms": round(1000 * self.seconds / max(1, self.scrapes), 2)}


def stack_metrics_urls(http_url: str, metrics_ports: dict[str, int]) -> list[str]:
    """The gateway's /metrics (on its HTTP port) and every internal service's."""
    return [f"{http_url}/metrics",
            *(f"http://127.0.0.1:{port}/metrics" for port in metrics_ports.values() if port)]
