"""gRPC server metrics of ServiceHost (minisgl_core.grpc_metrics): per method and status code,
a stream counted once when it ends, calls refused by the internal token counted too."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from minisgl_core.ports import free_port
from minisgl_core.security import InternalSecurity
from minisgl_core.serving import ServiceHost


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    if request == b"bad":
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    return request


def _count(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    yield from (bytes([i]) for i in range(request[0]))


def _sample(text: str, method: str, code: str) -> float:
    prefix = (f'minisgl_grpc_server_handled_total{{grpc_code="{code}",grpc_method="{method}",'
              'grpc_service="test.Echo"} ')
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_calls_and_streams_are_counted_by_method_and_code() -> None:
    metrics_port = free_port()
    host = ServiceHost("echo", "127.0.0.1", 0, metrics_port=metrics_port,
                       security=InternalSecurity(token="s3cret"))
    host.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(_echo),
        "Count": grpc.unary_stream_rpc_method_handler(_count)})])
    port = host.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary("/test.Echo/Echo")
            count = channel.unary_stream("/test.Echo/Count")
            ok = (("x-minisgl-internal-token", "s3cret"),)
            assert echo(b"hi", metadata=ok, timeout=10) == b"hi"
            assert echo(b"hi", metadata=ok, timeout=10) == b"hi"
            with pytest.raises(grpc.RpcError) as bad:
                echo(b"bad", metadata=ok, timeout=10)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as denied:
                echo(b"hi", timeout=10)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert len(list(count(bytes([5]), metadata=ok, timeout=10))) == 5
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=10).read().decode()
        assert _sample(text, "Echo", "OK") == 2.0
        assert _sample(text, "Echo", "INVALID_ARGUMENT") == 1.0
        assert _sample(text, "Echo", "UNAUTHENTICATED") == 1.0
        assert _sample(text, "Count", "OK") == 1.0  # five messages, one stream
        assert ('minisgl_grpc_server_handling_seconds_count{grpc_method="Echo",'
                'grpc_service="test.Echo"} 4.0') in text
    finally:
        host.stop(drain_timeout=0)
