"""Keeping one long-lived upstream stream open: the single reconnect loop behind every stream the
gateway holds (each engine's Connect and Watch, the detokenizer's Detokenize).

A stream is (re)opened only once the service's gRPC health says SERVING, polled with the jittered
backoff of minisgl_core.reconnect (at most 1 s); the channel's own reconnect backoff is capped too,
so a service that is back is found within about a second.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from minisgl_core.reconnect import Backoff

from minisgl_gateway import metrics

log = logging.getLogger(__name__)


class Stream(Protocol):
    async def wait_for_connection(self) -> None: ...

    def cancel(self) -> bool: ...


CallT = TypeVar("CallT", bound=Stream)


async def serving(health: health_pb2_grpc.HealthStub) -> bool:
    """Whether the service may take a stream now: one that listens but is not ready (a scheduler
    waiting for its worker, a service draining) would take the stream and end it at once, over
    and over. Waits up to a second for the channel to connect."""
    try:
        # The grpc_health stubs declare HealthStub without its methods.
        reply = await health.Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=1.0)
    except grpc.aio.AioRpcError as exc:
        # No health service there (UNIMPLEMENTED): the stream itself will tell.
        return exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def keep_open(name: str, health: health_pb2_grpc.HealthStub,
                    open_stream: Callable[[], CallT], serve: Callable[[CallT], Awaitable[None]],
                    down: Callable[[CallT], bool], lost: Callable[[str], None],
                    closing: Callable[[], bool], metric: str = "") -> None:
    """Keep one stream to `name` open until `closing()`: `serve(call)` runs it once connected,
    `down(call)` marks it down when it ends (True if it had been up), `lost(reason)` fails what it
    carried. `metric` labels the stream-loss counter (default: `name`)."""
    backoff = Backoff()
    while not closing():
        if not await serving(health):
            await asyncio.sleep(backoff.next())
            continue
        call = open_stream()
        reason = f"the {name} closed the stream"
        try:
            await call.wait_for_connection()
            backoff.reset()
            log.info("%s stream open", name)
            await serve(call)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave requests hanging
            log.exception("%s stream handler failed", name)
            reason = repr(exc)
        finally:
            was_up = down(call)
            call.cancel()
        if was_up:
            log.warning("%s stream lost: %s", name, reason)
            metrics.UPSTREAM_STREAM_LOSSES.labels(metric or name).inc()
        lost(reason)
        await asyncio.sleep(backoff.next())
