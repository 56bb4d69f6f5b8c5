"""The gateway's shared state: upstream channels, the pipeline, model info, keys and admission.

Both public APIs (api/http_app.py, api/grpc_service.py) hold one `Gateway` and go through it for
everything that touches an upstream service or a limit. It learns the model at start-up, with
the output formats (agent parsers) the APIs put on each chat job."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from hashlib import blake2b

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from minisgl_core.proto.minisgl.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from minisgl_core.security import from_args
from minisgl_core.serving import GRPC_OPTIONS, aio_channel

from minisgl_gateway import metrics
from minisgl_gateway.agent.registry import Formats, resolve_formats
from minisgl_gateway.config import GatewayConfig
from minisgl_gateway.errors import (
    ApiError,
    from_rpc_error,
    from_upstream,
    invalid,
    model_error,
    overloaded,
)
from minisgl_gateway.errors import unavailable as unavailable_error
from minisgl_gateway.request_context import upstream_metadata
from minisgl_gateway.slo import FirstTokenRate, check_ttft, queued_ahead
from minisgl_gateway.tenancy import Tenancy, tenant_of
from minisgl_gateway.upstream.migration import MigrationPolicy
from minisgl_gateway.upstream.pipeline import Pipeline
from minisgl_gateway.upstream.routing import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    formats: Formats  # its output parsers: --tool-call-parser / --reasoning-parser, or by name


@dataclass
class Slot:
    """One admitted generation request (`Gateway.reserve`); release it exactly once."""

    gateway: Gateway
    tenant: int = 0
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.gateway.active -= 1
            self.gateway.tenancy.release(self.tenant)
            metrics.RUNNING.dec()

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.limits = config.limits
        # Tokenize calls are stateless: round robin over every address the tokenizer target
        # resolves to (a headless Kubernetes Service, `dns:///name:port`, gives one per pod),
        # where the default pick_first would pin this gateway to one replica. The detokenizer
        # holds per-request state on one long-lived stream: first address only. Engines
        # (schedulers) are each their own channel, found by the pipeline's discovery.
        spread = [*GRPC_OPTIONS, ("grpc.lb_policy_name", "round_robin")]
        security = from_args(config.internal_token_file, config.internal_tls_dir)
        self._channels = {
            name: aio_channel(target, options, security)
            for name, target, options in (("tokenizer", config.tokenizer, spread),
                                          ("detokenizer", config.detokenizer, GRPC_OPTIONS))
        }
        self._tokenizer = tokenizer_pb2_grpc.TokenizerStub(self._channels["tokenizer"])
        router = Router(config.routing.policy, config.routing.balance_threshold,
                        config.routing.sticky_sessions, config.routing.queue_slack)
        self.pipeline = Pipeline(
            config.scheduler, self._channels["detokenizer"],
            channel_for=lambda target: aio_channel(target, GRPC_OPTIONS, security),
            retry_after=self.limits.retry_after_s, router=router,
            discovery_interval=config.routing.discovery_interval,
            migration=MigrationPolicy(config.routing.migration_attempts,
                                      config.routing.migration_wait))
        self._info: ModelInfo | None = None
        self._keys = [k.encode() for k in config.api_keys]
        self._shared_keys = {k.encode() for k in config.cache_shared_keys}
        if config.cache_salt_per_key and not self._keys:
            log.warning("--cache-salt-per-key has no effect without --api-key: every request "
                        "shares the prefix cache unless it sends a cache_salt")
        self.tenancy = Tenancy(config.tenancy)
        self.first_tokens = FirstTokenRate()  # the engines' queue drain rate, for --ttft-slo-ms
        self.active = 0  # admitted generation requests
        self.draining = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the streams and learn the model. Waits as long as the upstreams take when
        `startup_timeout` is 0, else raises TimeoutError after that many seconds."""
        self.pipeline.start()
        timeout = self.config.startup_timeout
        begin = time.monotonic()
        deadline = begin + timeout if timeout > 0 else float("inf")
        next_note = begin + 10.0
        while self._info is None or not self.pipeline.ready:
            problem = ""
            if self._info is None:
                try:
                    reply = await self._tokenizer.GetTokenizerInfo(
                        tokenizer_pb2.GetTokenizerInfoRequest(), wait_for_ready=True,
                        timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                    name = self.config.model_name or reply.model_name or "minisgl"
                    self._info = ModelInfo(
                        name=name, max_model_len=reply.max_model_len, vocab_size=reply.vocab_size,
                        formats=resolve_formats(name, self.config.tool_call_parser,
                                                self.config.reasoning_parser))
                    continue
                except grpc.aio.AioRpcError as exc:
                    problem = f"tokenizer at {self.config.tokenizer}: {exc.code().name}"
            else:
                await self.pipeline.wait_ready(min(1.0, max(0.0, deadline - time.monotonic())))
                problem = (f"no engine stream open ({self.config.scheduler}) or the detokenizer "
                           f"({self.config.detokenizer}) stream not open")
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"upstreams not ready after {timeout:.0f}s: {problem}")
            if now >= next_note:
                log.warning("still waiting for upstreams after %.0fs: %s", now - begin, problem)
                next_note = now + 30.0
            if self._info is None:
                await asyncio.sleep(0.2)
        log.info("serving model %s (context %d, vocab %d)", self.info.name,
                 self.info.max_model_len, self.info.vocab_size)

    async def close(self) -> None:
        await self.pipeline.close()
        for channel in self._channels.values():
            await channel.close()

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise unavailable_error("the gateway is starting up", self.limits.retry_after_s)
        return self._info

    # -- checks ------------------------------------------------------------------------------

    def check_key(self, authorization: str | None) -> None:
        """`authorization` is the header / metadata value ("Bearer KEY")."""
        if not self._keys:
            return
        if not authorization:
            raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'",
                           code="missing_api_key")
        scheme, _, key = authorization.strip().partition(" ")
        given = key.strip().encode("utf-8", "replace")
        # Compare with every key in constant time so the timing says nothing about which matched.
        matched = False
        for k in self._keys:
            matched |= hmac.compare_digest(given, k)
        if scheme.lower() != "bearer" or not matched:
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")

    def cache_salt(self, authorization: str | None, salt: str) -> str:
        """The prefix-cache namespace of a request with the client's `salt` ("" for none): with
        --cache-salt-per-key, a hash of its API key (never the key itself) comes first, so two
        keys never share pages whatever salts their clients pick. Call after `check_key`."""
        if not self.config.cache_salt_per_key or not self._keys or not authorization:
            return salt
        key = authorization.strip().partition(" ")[2].strip().encode("utf-8", "replace")
        if key in self._shared_keys:
            return salt
        tag = blake2b(key, digest_size=16, person=b"minisgl-keysalt").hexdigest()
        return f"key:{tag}\x00{salt}" if salt else f"key:{tag}"

    def check_model(self, name: str) -> None:
        if name and name != self.info.name:
            raise model_error(name)

    def check_capacity(self, tenant: int = 0) -> None:
        """Refuses (429, or 503 while draining) when no slot is free. Called before a body is
        read or parsed, so that a refusal under overload costs next to nothing; the slot itself
        is taken after parsing, so that a slow upload does not hold one. `tenant`: the key
        (`Gateway.tenant`), which competes for a fair share even when refused here."""
        self.tenancy.seen(tenant)
        if self.draining:
            raise unavailable_error("the gateway is shutting down", self.limits.retry_after_s)
        if self.active >= self.limits.max_concurrent_requests:
            raise overloaded(f"too many concurrent requests (limit "
                             f"{self.limits.max_concurrent_requests}); retry later",
                             self.limits.retry_after_s)

    def check_slo(self) -> None:
        """503 + Retry-After when the engines' queues say the TTFT target cannot be met."""
        slo = self.config.tenancy.ttft_slo_ms
        if slo > 0:
            views = [e.view for e in self.pipeline.links.values() if e.view.usable]
            check_ttft(slo, queued_ahead(views), self.first_tokens.rate(time.monotonic()))

    def tenant(self, authorization: str | None) -> int:
        """The key a request's quotas are counted against (a hash of its API key) while any
        per-key flag is set, else 0. Call after `check_key`."""
        return tenant_of(authorization) if self.tenancy.enabled else 0

    def reserve(self, tenant: int = 0) -> Slot:
        """Counts a generation request in flight until the slot is released; refuses past the
        limit, past the key's quotas or fair share (`tenant`: `Gateway.tenant`), past the TTFT
        target, or while draining."""
        self.check_capacity(tenant)
        self.check_slo()
        self.tenancy.admit(tenant, self.active, self.limits.max_concurrent_requests,
                           self.limits.retry_after_s)
        self.active += 1
        metrics.RUNNING.inc()
        return Slot(self, tenant)

    @contextlib.contextmanager
    def admit(self, tenant: int = 0) -> Iterator[None]:
        with self.reserve(tenant):
            yield

    # -- upstream calls ----------------------------------------------------------------------

    async def tokenize(self, prompts: Sequence[tokenizer_pb2.TokenizeItem], param: str
                       ) -> list[list[int]]:
        """Token ids of a generation's prompts, within the limits; `param` is the request field
        a prompt error points at."""
        info = self.info
        limit = info.max_model_len - 1
        if self.limits.max_prompt_tokens:
            limit = min(limit, self.limits.max_prompt_tokens)
        request = tokenizer_pb2.TokenizeRequest(items=prompts, max_prompt_tokens=limit)
        try:
            reply = await self._tokenizer.Tokenize(request, timeout=self.config.upstream_timeout,
                                                   metadata=upstream_metadata())
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error("tokenizer", exc, self.limits.retry_after_s) from None
        if len(reply.results) != len(prompts):
            raise ApiError(502, "the tokenizer answered with the wrong number of results",
                           code="upstream_error")
        out = []
        for result in reply.results:
            if result.error.code:
                raise from_upstream(result.error, self.limits.retry_after_s,
                                    param=param)
            ids = list(result.token_ids)
            if len(ids) > limit:
                raise invalid(f"the prompt has {len(ids)} tokens; at most {limit} are allowed "
                              f"(context window {info.max_model_len})", param=param,
                              code="context_length_exceeded")
            if not ids:
                raise invalid("the prompt is empty after tokenization", param=param)
            out.append(ids)
        return out

    async def token_strings(self, ids: list[int]) -> dict[int, str]:
        """Each id decoded on its own (logprob tokens): one DecodeTokens call for the batch."""
        unique = sorted(set(ids))
        if not unique:
            return {}
        try:
            reply = await self._tokenizer.DecodeTokens(
                tokenizer_pb2.DecodeTokensRequest(token_ids=unique),
                timeout=self.config.upstream_timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error("tokenizer", exc, self.limits.retry_after_s) from None
        if len(reply.texts) != len(unique):
            raise ApiError(502, "DecodeTokens answered with the wrong number of texts",
                           code="upstream_error")
        return dict(zip(unique, reply.texts, strict=True))

    async def tokenize_items(self, items: list[tokenizer_pb2.TokenizeItem]
                             ) -> list[tokenizer_pb2.TokenizeResult]:
        """/tokenize: results as they come (errors included), no generation limits."""
        request = tokenizer_pb2.TokenizeRequest(items=items,
                                                max_prompt_tokens=self.info.max_model_len)
        try:
            reply = await self._tokenizer.Tokenize(request, timeout=self.config.upstream_timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error("tokenizer", exc, self.limits.retry_after_s) from None
        return list(reply.results)

    async def detokenize(self, ids: list[int]) -> str:
        """The ids as one text (special tokens kept)."""
        try:
            reply = await self._tokenizer.DecodeTokens(
                tokenizer_pb2.DecodeTokensRequest(token_ids=ids, join=True),
                timeout=self.config.upstream_timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error("tokenizer", exc, self.limits.retry_after_s) from None
        if len(reply.texts) != 1:
            raise ApiError(502, "DecodeTokens(join) answered with the wrong number of texts",
                           code="upstream_error")
        return reply.texts[0]

    async def upstream_health(self) -> dict[str, bool]:
        async def check(channel: grpc.aio.Channel) -> bool:
            try:
                # The grpc_health stubs declare HealthStub without its methods.
                reply = await health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            except grpc.aio.AioRpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        names = list(self._channels)
        results = await asyncio.gather(*(check(self._channels[n]) for n in names))
        status = dict(zip(names, results, strict=True))
        # Ready with at least one usable engine: the others are routed around.
        status["scheduler"] = any(e.view.usable for e in self.pipeline.links.values())
        status["streams"] = self.pipeline.ready
        status["model_info"] = self._info is not None  # learned from the tokenizer at start-up
        return status
