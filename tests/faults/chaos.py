"""Pieces of the fault-injection suite: a running stack whose services are killed and started again
on their own ports, a light concurrent load that records how every request ended, and a probe that
measures the first success after a restart. Everything talks to real processes over loopback."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from minisgl.launcher import Stack
from minisgl_core.serving import wait_for_health

from tests.gateway.live_stack import sse_events

COMP = "/v1/completions"
MAX_TOKENS = 8
# A request that has not ended this long after it was sent counts as hung.
HANG_BOUND_S = 20.0
# Prompts of the load: short ones, and two that share a prefix of several KV pages (page = 16
# tokens on CPU) so that the prefix cache is in play when a service dies.
SHARED = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, counting "
          "each of the one hundred and twelve steps while the wind pushed against the glass. ")
LOAD_PROMPTS = ["Once upon a time", "The capital of France is", "In the beginning",
                SHARED + "He saw a ship", SHARED + "She wrote a letter"]
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def health(target: str) -> int | None:
    """The gRPC health status `target` reports, None when it does not answer."""
    with grpc.insecure_channel(target) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return None


def body(prompt: str, stream: bool = False, max_tokens: int = MAX_TOKENS) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


@dataclass
class Outcome:
    prompt: str
    stream: bool
    sent: float
    ended: float
    ok: bool
    text: str = ""
    cached_tokens: int = 0
    error: str = ""  # what the client saw when not ok: status + message, or the exception


def complete(base_url: str, prompt: str, stream: bool = False,
             max_tokens: int = MAX_TOKENS) -> Outcome:
    """One completion; never raises: how it ended is in the Outcome."""
    sent = time.monotonic()
    try:
        if stream:
            return _streamed(base_url, prompt, sent, max_tokens)
        reply = httpx.post(base_url + COMP, json=body(prompt, max_tokens=max_tokens),
                           timeout=HANG_BOUND_S + 10)
        if reply.status_code != 200:
            return Outcome(prompt, False, sent, time.monotonic(), False,
                           error=f"{reply.status_code} {reply.text[:200]}")
        data = reply.json()
        return Outcome(prompt, False, sent, time.monotonic(), True, data["choices"][0]["text"],
                       data["usage"]["prompt_tokens_details"]["cached_tokens"])
    except httpx.HTTPError as exc:  # the gateway died or was not listening
        return Outcome(prompt, stream, sent, time.monotonic(), False,
                       error=f"{type(exc).__name__}: {exc}")


def _streamed(base_url: str, prompt: str, sent: float, max_tokens: int) -> Outcome:
    text, cached, error, done = [], 0, "", False
    with httpx.stream("POST", base_url + COMP, json=body(prompt, True, max_tokens),
                      timeout=HANG_BOUND_S + 10) as reply:
        if reply.status_code != 200:
            reply.read()
            return Outcome(prompt, True, sent, time.monotonic(), False,
                           error=f"{reply.status_code} {reply.text[:200]}")
        for event in sse_events(reply):
            if event == "[DONE]":
                done = True
                break
            assert isinstance(event, dict)
            if "error" in event:
                error = f"stream error: {event['error'].get('message', '')}"
            for choice in event.get("choices", []):
                text.append(choice.get("text", ""))
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    ok = done and not error
    if not done and not error:
        error = "the stream ended without [DONE]"
    return Outcome(prompt, True, sent, time.monotonic(), ok, "".join(text) if ok else "",
                   cached, error)


class Load:
    """`workers` threads sending completions (every other one streamed) back to back, from
    `start()` until `stop()`; `paused` holds them between requests."""

    def __init__(self, base_url: str, workers: int = 3) -> None:
        self.base_url = base_url
        self.outcomes: list[Outcome] = []
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._idle = [threading.Event() for _ in range(workers)]
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(workers)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def _run(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            if self.paused.is_set():
                self._idle[i].set()
                time.sleep(0.05)
                continue
            self._idle[i].clear()
            outcome = complete(self.base_url, LOAD_PROMPTS[n % len(LOAD_PROMPTS)],
                               stream=n % 2 == 1)
            with self._lock:
                self.outcomes.append(outcome)
            n += 1
            if not outcome.ok:
                time.sleep(0.1)  # like a client honouring a short Retry-After

    def pause(self, timeout: float = HANG_BOUND_S + 15) -> None:
        """Until no request of the load is in flight."""
        self.paused.set()
        deadline = time.monotonic() + timeout
        while not all(e.is_set() for e in self._idle):
            assert time.monotonic() < deadline, "the load did not go idle"
            time.sleep(0.02)

    def resume(self) -> None:
        self.paused.clear()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(HANG_BOUND_S + 15)
            assert not t.is_alive(), "a load thread hangs"
        return self.outcomes


@dataclass
class Chaos:
    """A started Stack; any of its five services can be SIGKILLed and started again with its
    original command line (same ports), on its own."""

    stack: Stack
    log_dir: Path
    _logs: list[IO[bytes]] = field(default_factory=list)
    _restarts: int = 0

    @property
    def http_url(self) -> str:
        return self.stack.http_url

    def health_target(self, name: str) -> str:
        return self.stack.grpc_target if name == "gateway" else self.stack.target(name)

    def kill(self, name: str) -> None:
        proc = self.stack.processes[name]
        proc.kill()
        proc.wait(10)

    def start(self, name: str, timeout: float = 90.0) -> float:
        """Start `name` again; returns the time (monotonic) it reported SERVING."""
        old = self.stack.processes[name]
        assert old.poll() is not None, f"{name} is still running"
        self._restarts += 1
        log = open(self.log_dir / f"{name}-restart-{self._restarts}.log", "wb")  # noqa: SIM115
        self._logs.append(log)
        self.stack.processes[name] = subprocess.Popen(
            list(old.args), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent,
            # the launcher's environment for it too: the internal token file (and TLS dir)
            env={**os.environ, **self.stack._security_env(name), "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        while True:
            try:
                wait_for_health(self.health_target(name), timeout=1.0)
                return time.monotonic()
            except TimeoutError:
                if self.stack.processes[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not come back:\n" + Path(log.name).read_text(
                        errors="replace")[-3000:]) from None

    def first_success(self, prompt: str, since: float, timeout: float = 30.0) -> Outcome:
        """Send `prompt` until one succeeds; its `ended - since` is the recovery time."""
        deadline = since + timeout
        while True:
            outcome = complete(self.http_url, prompt)
            if outcome.ok:
                return outcome
            assert time.monotonic() < deadline, f"no success {timeout:.0f}s after healthy: " \
                                                f"{outcome.error}"
            time.sleep(0.05)

    def close(self) -> dict[str, int | None]:
        codes = self.stack.stop()
        for log in self._logs:
            log.close()
        return codes
