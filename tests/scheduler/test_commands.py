"""The loop's inbox commands, applied one by one on a `SchedulerLoop` whose thread is not started
(the test is the loop thread): each command type does what its RPC event means, and anything that
is not a command is refused (mypy refuses it first: `_apply` ends in `assert_never`)."""

from __future__ import annotations

import typing
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import FinishReason, Scheduler, SchedulerConfig
from minisgl_scheduler.commands import Batch, Call, Command, Drop, HalfClose, Open, Submit, Wake
from minisgl_scheduler.connection import Conn
from minisgl_scheduler.loop import SchedulerLoop, _Out

from .fake_executor import FakeExecutor

LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


def _loop() -> SchedulerLoop:
    fake = FakeExecutor(num_pages=64, page_size=4, max_slots=8, max_model_len=256, eos_every=0)
    return SchedulerLoop(Scheduler(fake, SchedulerConfig()))


def _apply(loop: SchedulerLoop, cmd: Command) -> _Out:
    """The updates the command made (refusals) by connection."""
    out: _Out = defaultdict(list)
    loop._apply(cmd, out)
    return out


def _open(loop: SchedulerLoop) -> Conn:
    conn = Conn(1)
    _apply(loop, Open(conn))
    return conn


def _submit(loop: SchedulerLoop, conn: Conn, *client_rids: int) -> None:
    submits = tuple(Submit(r, [r + 1, 2, 3], LONG) for r in client_rids)
    assert not _apply(loop, Batch(conn, submits=submits))  # nothing refused


def test_open_registers_the_connection_and_batch_submits_by_client_rid() -> None:
    loop = _loop()
    conn = _open(loop)
    assert conn in loop._conns
    _submit(loop, conn, 7, 8)
    assert set(conn.rids) == {7, 8}
    assert {loop._owners[rid].client_rid for rid in conn.rids.values()} == {7, 8}
    assert all(rid in loop.sched.reqs for rid in conn.rids.values())


def test_batch_aborts_then_stops_end_requests_with_their_reasons() -> None:
    loop = _loop()
    conn = _open(loop)
    _submit(loop, conn, 1, 2, 3)
    rids = dict(conn.rids)
    _apply(loop, Batch(conn, aborts=(1, 99), stops=(2,)))  # 99: not live, ignored
    assert rids[1] not in loop.sched.reqs and rids[2] not in loop.sched.reqs
    assert rids[3] in loop.sched.reqs
    events = {ev.rid: ev for ev in loop.sched.step()}
    assert events[rids[1]].finish_reason is FinishReason.ABORT
    assert events[rids[2]].finish_reason is FinishReason.STOP


def test_a_refused_submit_comes_back_as_an_error_update() -> None:
    loop = _loop()
    conn = _open(loop)
    _submit(loop, conn, 5)
    out = _apply(loop, Batch(conn, submits=(Submit(5, [1, 2], LONG),)))  # 5 is live
    (update,) = out[conn]
    assert update.rid == 5 and update.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert update.error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
    assert update.prompt_tokens == 2


def test_a_batch_of_an_ended_connection_does_nothing() -> None:
    loop = _loop()
    conn = _open(loop)
    _apply(loop, Drop(conn))
    _apply(loop, Batch(conn, submits=(Submit(1, [1, 2], LONG),)))
    assert not loop.sched.reqs and not conn.rids


def test_half_close_marks_the_connection() -> None:
    loop = _loop()
    conn = _open(loop)
    _apply(loop, HalfClose(conn))
    assert conn.half_closed and not conn.ended


def test_drop_aborts_the_connections_requests_and_ends_its_stream() -> None:
    loop = _loop()
    conn = _open(loop)
    _submit(loop, conn, 1, 2)
    _apply(loop, Drop(conn))
    assert not loop.sched.reqs and not loop._owners and not conn.rids
    assert conn.ended and conn not in loop._conns
    assert conn.outbox.get_nowait() is None  # the Connect RPC ends


def test_call_runs_on_the_loop_and_hands_back_a_result_or_an_exception() -> None:
    loop = _loop()
    ok: Future[Any] = Future()
    _apply(loop, Call(lambda: loop.sched.has_work(), ok))
    assert ok.result(timeout=0) is False
    failed: Future[Any] = Future()
    _apply(loop, Call(lambda: 1 // 0, failed))
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=0)


def test_wake_does_nothing() -> None:
    loop = _loop()
    assert _apply(loop, Wake()) == {}
    assert not loop._conns and not loop.sched.has_work()


def test_every_command_type_is_tested_here() -> None:
    tested = {Open, Batch, HalfClose, Drop, Call, Wake}
    assert set(typing.get_args(Command)) == tested


def test_what_is_not_a_command_is_refused() -> None:
    loop = _loop()
    with pytest.raises(AssertionError):
        _apply(loop, ("open", Conn(1)))  # type: ignore[arg-type]  # the old tuple form
