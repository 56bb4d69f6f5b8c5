"""SIGTERM, service by service, with streams in flight (real processes, greedy).

* gateway, scheduler: refuse new work, let every in-flight stream finish, exit 0 soon after the
  last one ends (within DRAIN_EXIT_S);
* detokenizer: keeps each gateway stream until no request on it is mid-generation, then ends it
  (the gateway reopens one elsewhere): in-flight streams finish, then it exits 0;
* tokenizer: unary calls only; exits 0 at once, streams already tokenized are not touched;
* worker: answers the steps it already launched, then ends its Step stream: the requests still
  generating end at once with a clear error (503), nothing hangs; exits 0 at once.
Each test starts its service again for the next one."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.gateway.live_stack import idle, scheduler_load, wait_for

from .chaos import LOAD_PROMPTS, Chaos, Outcome, complete

STREAMS = 4
TOKENS = 120  # ~2-4 s for 4 streams of the tiny model on 2 CPU cores
DRAIN_EXIT_S = 3.0
# The gateway's --migration-wait (default): how long a stream whose worker is gone waits for an
# engine to take it over, plus a housekeeping tick and the detokenizer's flush.
MIGRATION_WAIT_S = 10.0 + 1.0

pytestmark = pytest.mark.e2e


class InFlight:
    """STREAMS streamed completions of TOKENS tokens, generating when the constructor returns."""

    def __init__(self, chaos: Chaos) -> None:
        self.outcomes: list[Outcome] = []
        self._threads = [threading.Thread(target=self._one, args=(chaos, i)) for i in range(STREAMS)]
        for t in self._threads:
            t.start()
        sched = chaos.stack.target("scheduler")
        token = chaos.stack.token_file
        wait_for(lambda: scheduler_load(sched, token).running_requests == STREAMS, 20,
                 "all generating")

    def _one(self, chaos: Chaos, i: int) -> None:
        self.outcomes.append(complete(chaos.http_url, LOAD_PROMPTS[i % len(LOAD_PROMPTS)],
                                      stream=True, max_tokens=TOKENS))

    def join(self) -> list[Outcome]:
        for t in self._threads:
            t.join(60)
            assert not t.is_alive(), "a stream hangs"
        return self.outcomes


def sigterm(chaos: Chaos, name: str) -> float:
    chaos.stack.processes[name].send_signal(signal.SIGTERM)
    return time.monotonic()


def exited(chaos: Chaos, name: str, timeout: float = 40.0) -> float:
    assert chaos.stack.processes[name].wait(timeout) == 0, f"{name} did not exit 0"
    return time.monotonic()


@pytest.mark.parametrize("name", ["gateway", "scheduler", "detokenizer"])
def test_sigterm_lets_in_flight_streams_finish_then_exits(chaos: Chaos, name: str) -> None:
    flight = InFlight(chaos)
    sigterm(chaos, name)
    outcomes = flight.join()
    gone = exited(chaos, name)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    last = max(o.ended for o in outcomes)  # all were generating at the signal (InFlight)
    print(f"\n{name}: exited {gone - last:.2f}s after the last stream ended")
    assert gone - last < DRAIN_EXIT_S, f"{name} exited {gone - last:.1f}s after the last stream"
    chaos.start(name)
    assert chaos.first_success(LOAD_PROMPTS[0], time.monotonic()).ok


def test_tokenizer_sigterm_exits_at_once_without_touching_streams(chaos: Chaos) -> None:
    flight = InFlight(chaos)
    signalled = sigterm(chaos, "tokenizer")
    gone = exited(chaos, "tokenizer")
    print(f"\ntokenizer: exited {gone - signalled:.2f}s after SIGTERM")
    assert gone - signalled < DRAIN_EXIT_S
    outcomes = flight.join()
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    chaos.start("tokenizer")
    assert chaos.first_success(LOAD_PROMPTS[0], time.monotonic()).ok


def test_worker_sigterm_finishes_its_step_then_fails_the_rest_clearly(chaos: Chaos) -> None:
    flight = InFlight(chaos)
    signalled = sigterm(chaos, "worker")
    gone = exited(chaos, "worker")
    outcomes = flight.join()
    print(f"\nworker: exited {gone - signalled:.2f}s after SIGTERM, streams ended "
          f"{max(o.ended for o in outcomes) - signalled:.2f}s after it")
    assert gone - signalled < DRAIN_EXIT_S
    assert all(not o.ok and "worker" in o.error for o in outcomes), outcomes
    # The gateway first tries to migrate the streams: the engine is the only one and its
    # scheduler reports the worker down, so each is parked, waiting for the worker (not sent back
    # to fail at once), until --migration-wait runs out; then it fails with the worker's error.
    assert max(o.ended for o in outcomes) - signalled < DRAIN_EXIT_S + MIGRATION_WAIT_S
    sched, token = chaos.stack.target("scheduler"), chaos.stack.token_file
    wait_for(lambda: idle(sched, token), 10, "pages given back")
    chaos.start("worker")
    first = chaos.first_success(LOAD_PROMPTS[0], time.monotonic())
    assert first.ok and first.cached_tokens == 0  # a new process: its cache starts empty
