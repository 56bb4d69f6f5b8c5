"""One long request must not stall every stream (issue #55 item 10): on the CPU stack, whose
scheduler sizes prefill steps to a step-time target by default (--max-step-ms auto: 200 ms on a
CPU worker), an unrelated stream keeps receiving tokens while a request of 4 prompts x 2,047
tokens prefills. Without the target that request fills one step of 8,188 prompt tokens and the
stream pauses for the whole of it (seconds on 2 cores).

The bound is looser than the target: step times on a shared 2-core machine vary by 2-3x with the
other load (docs/operations.md, "Limits")."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e

MAX_GAP_S = 1.0


def test_a_long_request_does_not_stall_other_streams(stack) -> None:
    rng = random.Random()
    stop = threading.Event()
    arrivals: list[float] = []
    errors: list[BaseException] = []

    def stream() -> None:
        body = {"prompt": [rng.randrange(10, 4000) for _ in range(16)], "max_tokens": 1900,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", stack.http_url + "/v1/completions", json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
                    if stop.is_set():
                        return  # closing the response aborts the stream upstream
        except BaseException as exc:  # noqa: BLE001  # reported by the test thread
            errors.append(exc)

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    while len(arrivals) < 5 and time.monotonic() < deadline and not errors:
        time.sleep(0.05)
    assert len(arrivals) >= 5, errors
    prompts = [[rng.randrange(10, 4000) for _ in range(2047)] for _ in range(4)]
    begin = time.monotonic()
    r = httpx.post(stack.http_url + "/v1/completions", json={
        "prompt": prompts, "max_tokens": 1, "temperature": 0}, timeout=120)
    end = time.monotonic()
    stop.set()
    reader.join(timeout=30)
    assert r.status_code == 200, r.text
    assert not errors, errors
    during = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b >= begin and a <= end]
    assert during, "the stream ended before the long request"
    assert max(during) <= MAX_GAP_S, (f"a stream paused {max(during):.2f}s while a "
                                      f"{end - begin:.1f}s long request ran")
