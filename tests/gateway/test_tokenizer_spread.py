"""A gateway spreads its Tokenize calls over every tokenizer replica its target resolves to (the
Helm chart's headless Service gives one address per pod). Two real tokenizer servers on
loopback, a real gateway process in front of them and of the running stack's other services."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from minisgl_core.proto.minisgl.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from minisgl_core.serving import ServiceHost
from minisgl_tokenizer import ModelTokenizer
from minisgl_tokenizer.server import TokenizerServicer

from tests.gateway.conftest import start_gateway


class CountingTokenizer(TokenizerServicer):
    def __init__(self, model: ModelTokenizer) -> None:
        super().__init__(model)
        self.calls = 0
        self._lock = threading.Lock()

    def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,  # noqa: N802
                 context: grpc.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        with self._lock:
            self.calls += 1
        return super().Tokenize(request, context)


@pytest.fixture
def two_tokenizers(tiny_model_path: Path) -> Iterator[tuple[list[CountingTokenizer], str]]:
    model = ModelTokenizer.load(tiny_model_path)
    hosts, servicers, ports = [], [], []
    for _ in range(2):
        servicer = CountingTokenizer(model)
        host = ServiceHost("tokenizer", "127.0.0.1", 0, max_workers=4)
        host.add(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer,
                 "minisgl.v1.Tokenizer")
        ports.append(host.start())
        hosts.append(host)
        servicers.append(servicer)
    yield servicers, "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
    for host in hosts:
        host.stop(drain_timeout=1)


def test_tokenize_calls_reach_every_replica(two_tokenizers, upstream_targets: dict[str, str],
                                            tmp_path: Path) -> None:
    servicers, target = two_tokenizers
    gw = start_gateway({**upstream_targets, "tokenizer": target}, tmp_path)
    try:
        for i in range(12):
            reply = httpx.post(f"{gw.http_url}/v1/completions", timeout=60,
                               json={"prompt": f"replica {i}", "max_tokens": 1})
            assert reply.status_code == 200, reply.text
    finally:
        assert gw.stop() == 0
    calls = [s.calls for s in servicers]
    # 12 completions + the start-up GetTokenizerInfo (not counted): round robin gives 6 and 6;
    # pick_first would give 12 and 0.
    assert sum(calls) == 12 and min(calls) >= 3, calls
