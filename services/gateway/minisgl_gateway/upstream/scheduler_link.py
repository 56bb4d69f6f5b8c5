"""The gateway's link to one engine (a scheduler and its workers): one `Connect` stream for its
sequences and one `Watch` stream for its load and prefix-cache events, both kept open by
streams.keep_open, and the sequences it runs.

Submits, aborts and stops queued while a ConnectRequest is being written go out together in the
next one (one write per scheduler step at most, whatever the number of requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc
from minisgl_core.proto.minisgl.v1 import scheduler_pb2, scheduler_pb2_grpc

from minisgl_gateway import metrics
from minisgl_gateway.upstream.engine_view import EngineView
from minisgl_gateway.upstream.sequence import Sequence
from minisgl_gateway.upstream.streams import keep_open

log = logging.getLogger(__name__)

LOAD_INTERVAL_S = 0.1  # asked of the scheduler's Watch stream


@dataclass(frozen=True)
class LinkHooks:
    """What the pipeline does with a link's stream: a step's updates, and the loss of the
    stream with every sequence it carried (already taken out of `live`)."""

    on_step: Callable[[SchedulerLink, scheduler_pb2.ConnectResponse], Awaitable[None]]
    on_lost: Callable[[SchedulerLink, list[Sequence], str], None]


class SchedulerLink:
    def __init__(self, address: str, channel: grpc.aio.Channel, hooks: LinkHooks,
                 policy: str = "") -> None:
        self.address = address
        self.reported_cached = metrics.REPORTED_CACHED.labels(address, policy)
        self.predicted_cached = metrics.PREDICTED_CACHED.labels(address, policy)
        self.view = EngineView(address)
        self.channel = channel
        self._sched = scheduler_pb2_grpc.SchedulerStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._hooks = hooks
        self.live: dict[int, Sequence] = {}  # rid -> sequence, until the scheduler's last update
        self._submits: list[scheduler_pb2.SubmitItem] = []
        self._aborts: set[int] = set()
        self._stops: set[int] = set()  # ended by a stop string: finish upstream as STOP
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._connect_loop(), name=f"connect {self.address}"),
            asyncio.create_task(self._watch_loop(), name=f"watch {self.address}")]

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.channel.close(None)

    # -- sequences ---------------------------------------------------------------------------

    def submit(self, seq: Sequence, item: scheduler_pb2.SubmitItem) -> None:
        """Queue one sequence; it goes out with the next coalesced ConnectRequest."""
        seq.link = self
        self.live[seq.rid] = seq
        self._submits.append(item)
        self._wake.set()

    def cancel(self, seqs: list[Sequence]) -> None:
        """Abort these (already ended on the client side) upstream; drop the unsent ones."""
        running = {s.rid for s in seqs if s.rid in self.live}
        unsent = {item.rid for item in self._submits} & running
        if unsent:
            self._submits = [item for item in self._submits if item.rid not in unsent]
            for rid in unsent:
                del self.live[rid]
        for rid in running - unsent:
            self.abort(rid)

    def abort(self, rid: int, stop: bool = False) -> None:
        if rid in self.live:
            (self._stops if stop else self._aborts).add(rid)
            self._wake.set()

    # -- Connect -----------------------------------------------------------------------------

    async def _connect_loop(self) -> None:
        await keep_open(f"scheduler {self.address}", self._health, self._sched.Connect,
                        self._serve_connect, self._connect_down, self._connect_lost,
                        lambda: self._closing, metric="scheduler")

    async def _serve_connect(self, call: grpc.aio.StreamStreamCall) -> None:
        writer = asyncio.create_task(self._write_connect(call))
        self.view.up = True
        on_step = self._hooks.on_step
        try:
            async for response in call:
                await on_step(self, response)
        finally:
            writer.cancel()

    def _connect_down(self, call: grpc.aio.StreamStreamCall) -> bool:
        was_up, self.view.up = self.view.up, False
        return was_up

    def _connect_lost(self, reason: str) -> None:
        self._submits.clear()
        self._aborts.clear()
        self._stops.clear()
        seqs = list(self.live.values())
        self.live.clear()
        if seqs:
            self._hooks.on_lost(self, seqs, reason)

    async def _write_connect(self, call: grpc.aio.StreamStreamCall) -> None:
        """Everything queued since the last send goes out as one ConnectRequest."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if not self._submits and not self._aborts and not self._stops:
                    continue
                aborts = [rid for rid in self._aborts if rid in self.live]
                stops = [rid for rid in self._stops if rid in self.live]
                request = scheduler_pb2.ConnectRequest(submits=self._submits, aborts=aborts,
                                                       stops=stops)
                self._submits, self._aborts, self._stops = [], set(), set()
                await call.write(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader sees the broken stream and fails the requests
            log.warning("scheduler %s stream write failed: %r", self.address, exc)
            call.cancel()

    # -- Watch -------------------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        await keep_open(f"scheduler {self.address} watch", self._health, self._open_watch,
                        self._serve_watch, lambda call: False, lambda reason: None,
                        lambda: self._closing, metric="scheduler_watch")

    def _open_watch(self) -> grpc.aio.UnaryStreamCall:
        return self._sched.Watch(scheduler_pb2.WatchRequest(
            resume_after=self.view.seq, load_interval_s=LOAD_INTERVAL_S))

    async def _serve_watch(self, call: grpc.aio.UnaryStreamCall) -> None:
        view = self.view
        async for msg in call:
            if not view.apply(msg):
                log.warning("scheduler %s: cache event %d missing (got %d); resyncing",
                            self.address, view.seq + 1, msg.seq)
                return  # reopened with resume_after: a replay or a snapshot
