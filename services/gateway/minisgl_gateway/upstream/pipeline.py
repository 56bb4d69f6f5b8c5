"""The gateway's upstream streams, shared by every request of the process: one `Connect` (and one
`Watch`) per engine, one `Detokenize` to the detokenizer.

    submit ──Router──▶ SchedulerLink (Connect) ──ConnectResponse──▶ Detokenizing ──StepEvent──▶ sink

A `Sequence` is one rid (one choice of one request). Requests put their sequences in, read
`StepEvent`s from their sink and `cancel` what they no longer want. The engines come from
discovery (a static list, DNS or a file, re-resolved); new ones are used once their stream is
open, vanished ones take no new sequences and are closed when their last one ends.

When an engine's stream breaks, its sequences that have not produced a token yet are submitted
once more to another engine (also when a draining engine refuses them). Those with tokens are
migrated (migration.py): resubmitted with their outputs so far to another engine, or parked until
one takes them (the same engine once it is back), up to the policy's attempts and wait; past
those they get an error event. Nothing waits forever. An engine whose worker is down takes
nothing (engine_view.EngineView.worker_down): parked sequences wait for its worker, or another
engine, rather than bounce off it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable

import grpc
from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2

from minisgl_gateway import metrics
from minisgl_gateway.errors import ApiError, from_upstream, unavailable
from minisgl_gateway.upstream.detok import Detokenizing, DetokHooks
from minisgl_gateway.upstream.discovery import DEFAULT_INTERVAL_S, Discovery
from minisgl_gateway.upstream.migration import MigrationPolicy, fix_seed, resume_item
from minisgl_gateway.upstream.routing import Router
from minisgl_gateway.upstream.scheduler_link import LinkHooks, SchedulerLink
from minisgl_gateway.upstream.sequence import EventSink, Sequence, StepEvent, Upstream

log = logging.getLogger(__name__)

# A sequence the gateway gave up on (stop string, client gone) waits for the scheduler's final
# update to flush its detokenizer state; past this it is forgotten anyway.
ORPHAN_TIMEOUT_S = 60.0
HOUSEKEEPING_S = 0.5


class Pipeline:
    def __init__(self, scheduler: str, detokenizer: grpc.aio.Channel,
                 channel_for: Callable[[str], grpc.aio.Channel], retry_after: int = 1,
                 router: Router | None = None,
                 discovery_interval: float = DEFAULT_INTERVAL_S,
                 migration: MigrationPolicy | None = None) -> None:
        self._discovery = Discovery(scheduler)
        self._discovery_interval = discovery_interval
        self._channel_for = channel_for
        self._retry_after = retry_after
        self.router = router or Router()
        self.links: dict[str, SchedulerLink] = {}  # by address: one per engine
        self.migration = migration or MigrationPolicy()
        # Sequences being migrated that no engine has taken yet: rid -> (sequence, give-up time,
        # the loss it ends with then).
        self.parked: dict[int, tuple[Sequence, float, ApiError]] = {}
        self._link_hooks = LinkHooks(on_step=self._on_step, on_lost=self._on_lost)
        self.detok = Detokenizing(detokenizer, DetokHooks(abort=self._abort, retry=self._retry,
                                                         migrate=self._migrate_failed),
                                  retry_after)
        self.detok.started = self._detok_started
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    # -- public ------------------------------------------------------------------------------

    def start(self) -> None:
        if not self._discovery.dynamic:
            self._set_engines(self._discovery.static())
        self._tasks = [asyncio.create_task(self.detok.run(), name="detokenize"),
                       asyncio.create_task(self._housekeeping(), name="engines")]

    @property
    def ready(self) -> bool:
        return self.detok.ready and any(e.view.usable for e in self.links.values())

    @property
    def live(self) -> int:
        return sum(len(e.live) for e in self.links.values()) + len(self.parked)

    async def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.ready

    def submit(self, input_ids: list[int], sampling: common_pb2.SamplingParams,
               stop: common_pb2.StopConditions, index: int, sink: EventSink,
               session: str = "", traceparent: str = "", request_id: str = "",
               cache_salt: str = "", priority: int = 0, tenant: int = 0) -> Sequence:
        """Route one sequence to an engine; it goes out with that engine's next ConnectRequest.
        `traceparent` / `request_id` travel with it to the scheduler and the detokenizer;
        `cache_salt` to the scheduler (its prefix-cache namespace) and the router."""
        if not self.detok.ready:
            raise unavailable("the detokenizer connection is down; retry shortly",
                              self._retry_after)
        seq = Sequence(rid=self._new_rid(), index=index, sink=sink, stop=stop, session=session,
                       traceparent=traceparent, request_id=request_id)
        seq.item = scheduler_pb2.SubmitItem(rid=seq.rid, input_ids=input_ids, sampling=sampling,
                                            traceparent=traceparent, request_id=request_id,
                                            cache_salt=cache_salt, priority=priority,
                                            tenant=tenant)
        if self.migration.enabled:
            fix_seed(seq.item.sampling)
        if not self._route(seq, exclude=None, reason=""):
            raise unavailable("no engine is available (all down or draining); retry shortly",
                              self._retry_after)
        return seq

    def cancel(self, seqs: list[Sequence]) -> None:
        """The client no longer wants these: abort upstream with the next ConnectRequest."""
        by_link: dict[Upstream, list[Sequence]] = {}
        for seq in seqs:
            if not seq.done and seq.link is not None:
                by_link.setdefault(seq.link, []).append(seq)
            seq.end(None)
        for link, mine in by_link.items():
            link.cancel(mine)

    async def close(self) -> None:
        self._closing = self.detok.closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        error = unavailable("the gateway is shutting down", self._retry_after)
        for link in list(self.links.values()):
            for seq in link.live.values():
                seq.end(StepEvent(index=seq.index, finish_reason="error", error=error))
            link.live.clear()
            await link.close()
        for seq, _, _ in self.parked.values():
            seq.end(StepEvent(index=seq.index, finish_reason="error", error=error))
        self.parked.clear()

    # -- routing and failover ----------------------------------------------------------------

    def _new_rid(self) -> int:
        while True:
            rid = secrets.randbits(63)
            if rid and rid not in self.parked and not any(rid in e.live
                                                          for e in self.links.values()):
                return rid

    def _route(self, seq: Sequence, exclude: Upstream | None, reason: str,
               resumed: scheduler_pb2.SubmitItem | None = None) -> bool:
        """Submit `seq` (or its `resumed` continuation) to a usable engine other than
        `exclude`; False when there is none."""
        usable = [e for e in self.links.values() if e.view.usable and e is not exclude]
        if not usable:
            return False
        for link in usable:
            link.view.inflight = len(link.live)
        item = resumed or seq.item
        assert item is not None
        decision = self.router.pick([e.view for e in usable], item.input_ids, seq.session,
                                    item.cache_salt)
        link = self.links[decision.view.address]
        policy = self.router.policy
        metrics.ROUTED.labels(link.address, policy, reason or decision.reason).inc()
        link.predicted_cached.inc(decision.predicted_tokens)
        link.submit(seq, item)
        return True

    def _retry(self, seq: Sequence, update: scheduler_pb2.TokenUpdate | None = None) -> bool:
        """Move a sequence that has no token yet to another engine, once."""
        failed = seq.link
        if seq.retried or seq.done or seq.detok_started:
            return False
        if update is not None and failed is not None and _worker_lost(update):
            link = self.links.get(failed.address)
            if link is not None:
                link.view.hold_worker()
        seq.retried = True
        if not self._route(seq, exclude=failed, reason="retry"):
            return False
        if failed is not None:
            metrics.RETRIES.labels(failed.address).inc()
        return True

    def _migrate(self, seq: Sequence, failed: SchedulerLink, error: ApiError) -> bool:
        """Continue a sequence that has tokens elsewhere (or park it until an engine can take
        it); False when it may not move again."""
        policy = self.migration
        if not policy.enabled or seq.done or not seq.detok_started:
            return False
        # The attempts bound moves that got nowhere: a stream that no engine can carry on (one
        # that kills each worker it reaches at the same token, engines that fail it at once)
        # must not bounce forever. A stream that produced tokens since its last move lost its
        # engine to something else, so the count starts over. That stays bounded too: every
        # such move is paid for by at least one new token, and max_tokens caps those.
        if len(seq.outputs) > seq.moved_at:
            seq.migrations = 0
        if seq.migrations >= policy.attempts:
            metrics.MIGRATIONS.labels("failed").inc()
            log.warning("rid %d: no token since its last move and %d moves in a row; failing it",
                        seq.rid, seq.migrations)
            return False
        seq.migrations += 1
        seq.moved_at = len(seq.outputs)
        seq.link = None
        if not self._resume(seq, exclude=failed):
            self.parked[seq.rid] = (seq, time.monotonic() + policy.wait_s, error)
        return True

    def _migrate_failed(self, seq: Sequence, link: SchedulerLink,
                        update: scheduler_pb2.TokenUpdate) -> bool:
        """The engine ended `seq` with UNAVAILABLE after its first tokens: its stream is up but
        its worker is gone (or restarted and lost the KV). Move it like a lost stream's."""
        link.view.hold_worker()
        return self._migrate(seq, link, from_upstream(update.error, self._retry_after))

    def _resume(self, seq: Sequence, exclude: Upstream | None) -> bool:
        assert seq.item is not None
        if not self._route(seq, exclude, "migrate", resume_item(seq.item, seq.outputs)):
            return False
        metrics.MIGRATIONS.labels("resumed").inc()
        return True

    def _place_parked(self, now: float) -> None:
        """Parked sequences go to an engine as soon as one is usable; past their wait they fail
        (after the detokenizer has answered for their earlier tokens)."""
        expired: list[tuple[Sequence, ApiError]] = []
        for rid, (seq, deadline, error) in list(self.parked.items()):
            if seq.done:  # the client went away meanwhile: only its detokenizer state is left
                del self.parked[rid]
                self.detok.flush([seq])
            elif self._resume(seq, exclude=None):
                del self.parked[rid]
            elif now >= deadline:
                del self.parked[rid]
                expired.append((seq, error))
        if expired:
            metrics.MIGRATIONS.labels("failed").inc(len(expired))
            log.warning("%d sequences found no engine within %.1fs; failing them",
                        len(expired), self.migration.wait_s)
        for seq, error in expired:
            self._strand([seq], [seq], dataclasses.replace(
                error, message=f"{error.message}; no engine took the stream over within "
                f"{self.migration.wait_s:g}s"))

    def _on_lost(self, link: SchedulerLink, seqs: list[Sequence], reason: str) -> None:
        error = unavailable(f"lost the connection to the scheduler at {link.address} "
                            f"({reason})", self._retry_after)
        stranded = [seq for seq in seqs
                    if not self._retry(seq) and not self._migrate(seq, link, error)]
        if len(stranded) < len(seqs):
            log.warning("moved %d sequences off scheduler %s", len(seqs) - len(stranded),
                        link.address)
        self._strand(stranded, [s for s in seqs if s.link is link], error)

    def _strand(self, stranded: list[Sequence], flush: list[Sequence], error: ApiError) -> None:
        """End `stranded` with `error`, after flushing the detokenizer state of `flush`: a
        sequence whose flush went out ends once its earlier tokens have reached the client."""
        flushed = {id(s) for s in self.detok.flush(flush)}
        for seq in stranded:
            if seq.done:
                continue
            if id(seq) in flushed:  # its first tokens may still be on their way to the client
                seq.lost = error
            else:
                seq.end(StepEvent(index=seq.index, finish_reason="error", error=error))

    async def _on_step(self, link: SchedulerLink, response: scheduler_pb2.ConnectResponse) -> None:
        await self.detok.on_step(link, response)

    def _abort(self, seq: Sequence, stop: bool) -> None:
        if seq.link is not None:
            seq.link.abort(seq.rid, stop)

    def _detok_started(self) -> list[Sequence]:
        live = [s for e in self.links.values() for s in e.live.values() if s.detok_started]
        return live + [s for s, _, _ in self.parked.values() if s.detok_started]

    # -- engines: one link each ---------------------------------------------------------------

    def _set_engines(self, addresses: list[str]) -> None:
        for address in addresses:
            link = self.links.get(address)
            if link is None:
                log.info("engine %s added", address)
                link = SchedulerLink(address, self._channel_for(address), self._link_hooks,
                                self.router.policy)
                self.links[address] = link
                link.start()
            link.view.retired = False
        for address, link in self.links.items():
            if address not in addresses and not link.view.retired:
                log.info("engine %s left discovery: finishing its %d sequences", address,
                         len(link.live))
                link.view.retired = True

    async def _housekeeping(self) -> None:
        next_resolve = 0.0
        while True:
            now = time.monotonic()
            if self._discovery.dynamic and now >= next_resolve:
                next_resolve = now + self._discovery_interval
                addresses = await self._discovery.resolve()
                if addresses is not None:
                    self._set_engines(addresses)
            for address, link in list(self.links.items()):
                if link.view.retired and not link.live:
                    del self.links[address]
                    with contextlib.suppress(KeyError):  # never labelled if it left at once
                        metrics.ENGINE_UP.remove(address)
                    await link.close()
                    continue
                metrics.ENGINE_UP.labels(address).set(1 if link.view.usable else 0)
                link.view.prune(now)
                self._forget_orphans(link, now)
            if self.parked:
                self._place_parked(now)
            await asyncio.sleep(HOUSEKEEPING_S)

    def _forget_orphans(self, link: SchedulerLink, now: float) -> None:
        stale = [r for r, s in link.live.items()
                 if s.done and now - s.done_at > ORPHAN_TIMEOUT_S]
        for rid in stale:
            log.warning("forgetting rid %d: no final update %.0fs after its abort",
                        rid, ORPHAN_TIMEOUT_S)
            del link.live[rid]


def _worker_lost(update: scheduler_pb2.TokenUpdate) -> bool:
    """An engine refused or failed a sequence because its worker is gone (or draining)."""
    return bool(update.error.code == common_pb2.ERROR_CODE_UNAVAILABLE)
