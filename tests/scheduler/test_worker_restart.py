"""A worker that restarts loses its KV cache: the scheduler must notice (a new epoch) and drop every
cached prefix and page mapping before it plans again. The fake worker checks every KV read, so a
plan that trusted a stale cached prefix would produce other tokens than `reference()`."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from minisgl_core.sampling import SamplingParams
from minisgl_core.step import WorkerInfo
from minisgl_scheduler import FinishReason, Scheduler, SchedulerConfig
from minisgl_scheduler.errors import WorkerFailed

from .fake_executor import FakeExecutor, reference
from .helpers import Recorder, assert_all_pages_back, run

PROMPT = list(range(10, 30))  # 20 tokens: 5 pages of 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class RestartingWorker(FakeExecutor):
    """A fake worker process that can be replaced by a new one (empty KV, new epoch), and can be
    unreachable in between."""

    def __init__(self, **kwargs: object) -> None:
        self._kwargs = kwargs
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.epoch = 1
        self._info = dataclasses.replace(self._info, epoch=self.epoch)
        self._known = self.epoch
        self.down = False

    def restart(self, **changes: object) -> None:
        epoch = self.epoch + 1
        FakeExecutor.__init__(self, **{**self._kwargs, **changes})  # type: ignore[arg-type]
        self.epoch = epoch
        self._info = dataclasses.replace(self._info, epoch=epoch)

    def check_worker(self) -> WorkerInfo | None:
        if self.down:
            raise WorkerFailed("the worker at fake is unreachable")
        if self.epoch == self._known:
            return None
        self._known = self.epoch
        return self._info


def test_restart_while_idle_drops_the_cache_and_outputs_stay_the_same(
        caplog: pytest.LogCaptureFixture) -> None:
    worker = RestartingWorker(num_pages=32, page_size=4, max_slots=4)
    sched = Scheduler(worker, SchedulerConfig())
    want = reference(PROMPT, GREEDY, worker)
    rec = Recorder()
    sched.submit(1, PROMPT, GREEDY)
    sched.submit(2, PROMPT, GREEDY)
    run(sched, rec)
    sched.submit(3, PROMPT, GREEDY)
    run(sched, rec)
    assert rec.out[3].cached_tokens == 16 and rec.out[3].tokens == want  # the cache is used

    worker.restart(num_pages=24)  # a new process, even with another pool size
    with caplog.at_level(logging.WARNING):
        sched.submit(4, PROMPT, GREEDY)
        run(sched, rec)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "worker restarted" in warnings[0].getMessage()
    assert rec.out[4].cached_tokens == 0 and rec.out[4].tokens == want
    assert sched.kv.num_pages == 24
    sched.submit(5, PROMPT, GREEDY)
    run(sched, rec)
    assert rec.out[5].cached_tokens == 16 and rec.out[5].tokens == want
    assert_all_pages_back(sched)


def test_restart_mid_generation_fails_running_requests_clearly() -> None:
    worker = RestartingWorker(num_pages=32, page_size=4, max_slots=4)
    sched = Scheduler(worker, SchedulerConfig(disable_overlap=True))
    rec = Recorder()
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    sched.submit(1, PROMPT, long)
    for _ in range(3):
        rec.add(sched.step())
    worker.restart()
    sched.submit(2, PROMPT, GREEDY)  # waiting at the restart: served by the new worker
    run(sched, rec)
    assert rec.out[1].finish is FinishReason.ERROR
    assert "worker restarted" in rec.out[1].error.message  # type: ignore[union-attr]
    assert rec.out[2].finish is FinishReason.LENGTH and rec.out[2].cached_tokens == 0
    assert rec.out[2].tokens == reference(PROMPT, GREEDY, worker)
    assert_all_pages_back(sched)


def test_unreachable_worker_fails_waiting_requests_at_once() -> None:
    worker = RestartingWorker(num_pages=32, page_size=4, max_slots=4)
    sched = Scheduler(worker, SchedulerConfig())
    worker.down = True
    sched.submit(1, PROMPT, GREEDY)
    rec = Recorder()
    rec.add(sched.step())
    assert rec.out[1].finish is FinishReason.ERROR and "unreachable" in rec.out[1].error.message
    assert not sched.has_work()
