"""A stack with several engines for the routing tests: the launcher's Stack with
`engine_replicas`, its gateway reading the engine list from a file (re-read every 0.3 s), extra
gateway processes with other policies over the same engines, and the engines' own metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from minisgl.launcher import Stack, StackConfig
from minisgl_core.ports import free_port
from minisgl_core.proto.minisgl.v1 import scheduler_pb2, scheduler_pb2_grpc
from minisgl_core.serving import wait_for_health
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
           **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


@dataclass
class Cluster:
    stack: Stack
    engine_file: Path

    def engine_keys(self) -> list[str]:
        return [self.stack.engine_key("scheduler", i) for i in range(self.stack.engines)]

    def engine_metrics(self, key: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape(f"http://127.0.0.1:{self.stack.metrics_ports[key]}/metrics")

    def cache_counters(self, keys: list[str] | None = None) -> tuple[float, float]:
        """(prefix-cache hit tokens, query tokens) summed over the engines."""
        hits = queries = 0.0
        for key in keys or self.engine_keys():
            m = self.engine_metrics(key)
            hits += metric(m, "minisgl_prefix_cache_hits_total")
            queries += metric(m, "minisgl_prefix_cache_queries_total")
        return hits, queries

    def load(self, key: str) -> scheduler_pb2.GetLoadResponse:
        with grpc.insecure_channel(self.stack.target(key)) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetLoad(
                scheduler_pb2.GetLoadRequest(), timeout=5)

    def write_engines(self, targets: list[str]) -> None:
        tmp = self.engine_file.with_suffix(".tmp")
        tmp.write_text("\n".join(targets) + "\n")
        os.replace(tmp, self.engine_file)  # never a half-written list


@contextmanager
def running_cluster(model: Path, log_dir: Path, engines: int, routing: str,
                    gateway_args: tuple[str, ...] = (),
                    scheduler_args: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """`engines` engines behind one gateway that reads them from a file (`Cluster.write_engines`
    changes the set), routing with `routing`; stopped on exit."""
    engine_file = log_dir / "engines.txt"
    extra = {"gateway": ["--scheduler", f"file://{engine_file}", *gateway_args,
                         "--routing", routing]}
    if scheduler_args:
        extra["scheduler"] = list(scheduler_args)
    config = StackConfig(
        model_path=str(model), http_port=free_port(), grpc_port=free_port(),
        internal_ports=dict.fromkeys(("worker", "tokenizer", "detokenizer", "scheduler"), 0),
        engine_replicas=engines, log_dir=log_dir, internal_token=False, extra_args=extra)
    stack = Stack(config)
    cluster = Cluster(stack, engine_file)
    cluster.write_engines(stack.scheduler_targets)
    stack.start()
    try:
        yield cluster
    finally:
        stack.stop()


@dataclass
class ExtraGateway:
    proc: subprocess.Popen[bytes]
    http_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def start_gateway(stack: Stack, scheduler: str, log_dir: Path, *extra: str) -> ExtraGateway:
    http, grpc_port = free_port(), free_port()
    log_path = log_dir / f"gateway-{http}.log"
    cmd = [sys.executable, "-m", "minisgl_gateway", "--port", str(http), "--grpc-port",
           str(grpc_port), "--tokenizer", stack.target("tokenizer"), "--detokenizer",
           stack.target("detokenizer"), "--scheduler", scheduler, *extra]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    gw = ExtraGateway(proc, http, log_path)
    try:
        wait_for_health(f"127.0.0.1:{grpc_port}", timeout=60)
    except TimeoutError:
        proc.kill()
        raise RuntimeError("gateway did not start:\n" + log_path.read_text()[-3000:]) from None
    return gw


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
