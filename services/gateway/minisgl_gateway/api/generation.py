"""Running one job: validate, tokenize, submit its sequences, and turn their step events into
choice chunks (with logprob token strings) and usage. Protocol-agnostic: HTTP and gRPC format the
chunks; both call `close()` when they are done, which aborts whatever is still running."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from minisgl_core.logging import REQUEST_ID, log_fields
from minisgl_core.proto.minisgl.v1 import common_pb2

from minisgl_gateway import metrics
from minisgl_gateway.api.job import (
    Job,
    check_grammar,
    check_job,
    choice_seed,
    resolve_max_tokens,
)
from minisgl_gateway.gateway import Gateway
from minisgl_gateway.request_context import traceparent
from minisgl_gateway.upstream.sequence import EventSink, Sequence, StepEvent

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob)


@dataclass(slots=True)
class ChoiceChunk:
    """New output of one choice since the previous chunk (all of it for a unary answer)."""

    index: int
    text: str = ""
    token_ids: Seq[int] = field(default_factory=list)  # maybe the scheduler message's field
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    matched_stop: str = ""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Generation:
    def __init__(self, gateway: Gateway, job: Job) -> None:
        # Checked first: nothing below may be sized by an unchecked n (gRPC n is a uint32).
        info = gateway.info
        gateway.check_model(job.model)
        check_job(job, gateway.limits, info.max_model_len, info.vocab_size)
        self.gateway = gateway
        self.job = job
        self.arrival = time.monotonic()
        self._metrics = metrics.for_model(info.name)
        self._sink = EventSink()
        self._num_choices = job.num_choices
        self._want_logprobs = job.sampling.logprobs
        self._seqs: list[Sequence] = []
        self._prompt_lens: list[int] = []
        self._completion = [0] * job.num_choices
        self._cached = [0] * job.num_choices
        self._last_token_at: list[float | None] = [None] * job.num_choices
        self._first_token_at: float | None = None
        self._finished = 0
        self._closed = False

    @property
    def num_choices(self) -> int:
        return self._num_choices

    async def start(self) -> None:
        """Checks, tokenizes and submits; raises ApiError when the request cannot run."""
        gw, job = self.gateway, self.job
        info = gw.info
        if job.sampling.HasField("grammar"):
            await asyncio.to_thread(check_grammar, job)
        prompts = await gw.tokenize(job.prompts, job.prompt_param)
        # Every sequence of the request carries its id and trace context to each service.
        trace_ctx, request_id = traceparent(), REQUEST_ID.get()
        budgets = [resolve_max_tokens(job, len(ids), info.max_model_len, gw.limits)
                   for ids in prompts]
        self._prompt_lens = [len(ids) for ids in prompts]
        self._metrics.params_n.observe(job.n)
        # The scheduler interleaves keys only with --key-fair-share; else one group (arrival).
        sched_tenant = job.tenant if gw.config.tenancy.key_fair_share else 0
        for p, (ids, budget) in enumerate(zip(prompts, budgets, strict=True)):
            for j in range(job.n):
                sampling = common_pb2.SamplingParams()
                sampling.CopyFrom(job.sampling)
                sampling.max_tokens = budget
                if job.sampling.HasField("seed"):
                    sampling.seed = choice_seed(job.sampling.seed, j)
                self._seqs.append(gw.pipeline.submit(ids, sampling, job.stop, p * job.n + j,
                                                     self._sink, job.session, trace_ctx,
                                                     request_id, job.cache_salt,
                                                     job.priority, sched_tenant))

    async def chunks(self) -> AsyncIterator[list[ChoiceChunk]]:
        """Chunks as they come, several choices per item; raises ApiError if a choice fails."""
        take = self._sink.take
        while self._finished < self._num_choices:
            events = await take()
            for event in events:
                if event.error is not None:
                    self.close()
                    raise event.error
            strings: dict[int, str] = {}
            if self._want_logprobs:
                ids = [t for e in events for t in e.token_ids]
                ids += [t for e in events for top in e.top_logprobs for t in top.token_ids]
                strings = await self.gateway.token_strings(ids)
            yield self._merge(events, strings)

    async def collect(self, observe: Callable[[ChoiceChunk], None] | None = None
                      ) -> list[ChoiceChunk]:
        """The whole answer: one chunk per choice. `observe` sees every chunk as it comes (output
        parsers count reasoning tokens per chunk)."""
        whole = [ChoiceChunk(index=i) for i in range(self.num_choices)]
        ids: list[list[int]] = [[] for _ in whole]
        async for chunks in self.chunks():
            for c in chunks:
                if observe is not None:
                    observe(c)
                w = whole[c.index]
                w.text += c.text
                ids[c.index] += c.token_ids
                w.logprobs += c.logprobs
                w.finish_reason, w.matched_stop = c.finish_reason, c.matched_stop
        for w, token_ids in zip(whole, ids, strict=True):
            w.token_ids = token_ids
        return whole

    def usage(self) -> Usage:
        # Prompt tokens count once per prompt, not once per choice (OpenAI's convention).
        cached = sum(min(self._cached[p * self.job.n], n)
                     for p, n in enumerate(self._prompt_lens))
        return Usage(sum(self._prompt_lens), sum(self._completion), cached)

    def close(self) -> None:
        """Abort what still runs upstream and record the request's metrics (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.gateway.pipeline.cancel(self._seqs)
        usage = self.usage()
        self.gateway.tenancy.charge(self.job.tenant, usage.prompt_tokens + usage.completion_tokens)
        self._metrics.prompt_tokens.inc(usage.prompt_tokens)
        self._metrics.generation_tokens.inc(usage.completion_tokens)
        done = self._finished == self.num_choices and self.num_choices > 0
        if done:
            self._metrics.e2e.observe(time.monotonic() - self.arrival)
        log.debug("request ended", extra=log_fields(
            kind=self.job.kind, choices=self.num_choices, complete=done,
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens, seconds=round(time.monotonic() - self.arrival, 4)))

    def _merge(self, events: list[StepEvent], strings: dict[int, str]) -> list[ChoiceChunk]:
        """One chunk per choice out of a batch of events (`strings`: logprob token texts)."""
        now = time.monotonic()
        if len(events) == 1:  # the usual case: the event's fields become the chunk's as they are
            e = events[0]
            chunk = ChoiceChunk(e.index, e.text, e.token_ids)
            self._account(chunk, e, strings, now)
            return [chunk]
        by_index: dict[int, ChoiceChunk] = {}
        grown: dict[int, list[int]] = {}  # token ids of choices with several events, copied once
        for e in events:
            index = e.index
            found = by_index.get(index)
            if found is None:
                chunk = by_index[index] = ChoiceChunk(index, e.text, e.token_ids)
            else:
                chunk = found
                chunk.text += e.text
                ids = grown.get(index)
                if ids is None:
                    ids = grown[index] = list(chunk.token_ids)
                    chunk.token_ids = ids
                ids += e.token_ids
            self._account(chunk, e, strings, now)
        return sorted(by_index.values(), key=lambda c: c.index)

    def _account(self, chunk: ChoiceChunk, e: StepEvent, strings: dict[int, str],
                 now: float) -> None:
        """The event's logprobs, finish, token counts and latency metrics (text and ids are
        already in the chunk)."""
        index = e.index
        if self._want_logprobs:
            chunk.logprobs += self._logprobs(e, strings)
        if e.finish_reason is not None:
            chunk.finish_reason, chunk.matched_stop = e.finish_reason, e.matched_stop
            self._finished += 1
        num_tokens = len(e.token_ids)
        self._completion[index] += num_tokens
        if e.cached_tokens > self._cached[index]:
            self._cached[index] = e.cached_tokens
        if num_tokens:
            if self._first_token_at is None:
                self._first_token_at = now
                self._metrics.ttft.observe(now - self.arrival)
                self.gateway.first_tokens.record(now)
            last = self._last_token_at[index]
            if last is not None:
                self._metrics.itl.observe(now - last)
            self._last_token_at[index] = now

    @staticmethod
    def _logprobs(event: StepEvent, strings: dict[int, str]) -> list[TokenLogprob]:
        out = []
        for k, token in enumerate(event.token_ids):
            lp = event.logprobs[k] if k < len(event.logprobs) else 0.0
            top: list[tuple[int, str, float]] = []
            if k < len(event.top_logprobs):
                alt = event.top_logprobs[k]
                pairs = zip(alt.token_ids, alt.logprobs, strict=False)
                top = [(t, strings.get(t, ""), p) for t, p in pairs]
            out.append(TokenLogprob(token, strings.get(token, ""), lp, top))
        return out
