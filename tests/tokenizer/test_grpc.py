"""The services over real gRPC on loopback: in-process servers for the API, real processes for the
command line, environment variables, metrics and a clean SIGTERM."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from minisgl_core.config import env_name
from minisgl_core.ports import free_port
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from minisgl_core.serving import ServiceHost, channel, wait_for_health
from minisgl_tokenizer import ModelTokenizer, PromptTokenizer, TextPrompt
from minisgl_tokenizer.server import DetokenizerServicer, TokenizerServicer

INVALID = common_pb2.ERROR_CODE_INVALID_ARGUMENT
TOO_LONG = common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED


@pytest.fixture(scope="module")
def model(llama_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.load(llama_dir, max_model_len=64)


@pytest.fixture(scope="module")
def servers(model: ModelTokenizer) -> Iterator[tuple[str, str, DetokenizerServicer]]:
    tok_host = ServiceHost("tokenizer", "127.0.0.1", 0, max_workers=4)
    tok_host.add(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, TokenizerServicer(model),
                 "minisgl.v1.Tokenizer")
    detok_servicer = DetokenizerServicer(model)
    detok_host = ServiceHost("detokenizer", "127.0.0.1", 0, max_workers=4)
    detok_host.add(detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, detok_servicer,
                   "minisgl.v1.Detokenizer")
    detok_host.on_drain(detok_servicer.drain)
    targets = (f"127.0.0.1:{tok_host.start()}", f"127.0.0.1:{detok_host.start()}")
    yield targets[0], targets[1], detok_servicer
    tok_host.stop(drain_timeout=2)
    detok_host.stop(drain_timeout=2)


def chat(*messages: tuple[str, str], tools_json: str = "") -> tokenizer_pb2.TokenizeItem:
    return tokenizer_pb2.TokenizeItem(chat=tokenizer_pb2.ChatInput(
        messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages],
        tools_json=tools_json))


def test_tokenize_batch_with_per_item_errors(servers, model: ModelTokenizer) -> None:
    with channel(servers[0]) as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        items = [
            tokenizer_pb2.TokenizeItem(text="Hello café 🎉"),
            tokenizer_pb2.TokenizeItem(text="Hello café 🎉", add_special_tokens=False),
            tokenizer_pb2.TokenizeItem(token_ids=common_pb2.TokenIds(ids=[5, 6, 7])),
            tokenizer_pb2.TokenizeItem(token_ids=common_pb2.TokenIds(ids=[5, model.vocab_size])),
            tokenizer_pb2.TokenizeItem(token_ids=common_pb2.TokenIds(ids=[-3])),
            chat(("user", "Hi")),
            tokenizer_pb2.TokenizeItem(chat=tokenizer_pb2.ChatInput()),  # no messages
            chat(("user", "Hi"), tools_json="{not json"),
            tokenizer_pb2.TokenizeItem(text="word " * 200),  # over the 64-token context
            tokenizer_pb2.TokenizeItem(),  # no input at all
            tokenizer_pb2.TokenizeItem(text="", add_special_tokens=False),  # 0 tokens
        ]
        reply = stub.Tokenize(tokenizer_pb2.TokenizeRequest(items=items), timeout=10)
        results = list(reply.results)
        assert len(results) == len(items)
        plain = PromptTokenizer(model).tokenize([TextPrompt("Hello café 🎉"),
                                                 TextPrompt("Hello café 🎉", False)])
        assert list(results[0].token_ids) == plain[0].token_ids
        assert list(results[1].token_ids) == plain[1].token_ids
        assert list(results[2].token_ids) == [5, 6, 7]
        codes = [r.error.code for r in results]
        assert codes == [0, 0, 0, INVALID, INVALID, 0, INVALID, INVALID, TOO_LONG, INVALID, INVALID]
        assert "out of range" in results[3].error.message
        assert "tools_json" in results[7].error.message
        assert "64" in results[8].error.message and not results[8].token_ids
        assert list(results[5].token_ids)[0] == model.tokenizer.token_to_id("<|begin_of_text|>")
        # An explicit limit below the context window.
        reply = stub.Tokenize(tokenizer_pb2.TokenizeRequest(
            items=[tokenizer_pb2.TokenizeItem(text="one two three four")], max_prompt_tokens=2))
        assert reply.results[0].error.code == TOO_LONG
        # Still serving.
        info = stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=10)
        assert info.max_model_len == 64 and info.has_chat_template
        assert list(info.eos_token_ids) == model.eos_token_ids
        assert info.vocab_size == model.vocab_size
        ids = model.tokenizer.encode("ab 中", add_special_tokens=False).ids
        texts = stub.DecodeTokens(tokenizer_pb2.DecodeTokensRequest(token_ids=ids + [10**6]))
        assert list(texts.texts) == [model.tokenizer.decode([i]) for i in ids] + [""]


class _Requests:
    """A request stream the test writes to while reading the replies."""

    def __init__(self) -> None:
        self.q: queue.Queue[detokenizer_pb2.DetokenizeRequest | None] = queue.Queue()

    def __iter__(self) -> Iterator[detokenizer_pb2.DetokenizeRequest]:
        while (item := self.q.get()) is not None:
            yield item

    def send(self, *updates: detokenizer_pb2.DetokenizeUpdate) -> None:
        self.q.put(detokenizer_pb2.DetokenizeRequest(updates=updates))


def test_detokenize_stream(servers, model: ModelTokenizer) -> None:
    tok = model.tokenizer
    a = tok.encode("Bonjour, ça va? 你好 👍🏽", add_special_tokens=False).ids
    b = tok.encode("The answer is 42. STOP here", add_special_tokens=False).ids
    requests = _Requests()
    with channel(servers[1]) as ch:
        replies = detokenizer_pb2_grpc.DetokenizerStub(ch).Detokenize(iter(requests), timeout=30)
        text = {1: "", 2: ""}
        stopped = []
        stop = common_pb2.StopConditions(stop=["STOP"])
        for step in range(max(len(a), len(b)) + 1):
            updates = []
            if step <= len(a):
                updates.append(detokenizer_pb2.DetokenizeUpdate(
                    rid=1, token_ids=a[step:step + 1], finished=step == len(a)))
            if step <= len(b):
                updates.append(detokenizer_pb2.DetokenizeUpdate(
                    rid=2, token_ids=b[step:step + 1], finished=step == len(b),
                    stop=stop if step == 0 else None))
            requests.send(*updates)
            reply = next(replies)
            assert [d.rid for d in reply.deltas] == [u.rid for u in updates]
            for d in reply.deltas:
                text[d.rid] += d.text
                assert "\ufffd" not in d.text
                if d.stopped:
                    stopped.append(d)
        assert text[1] == tok.decode(a)
        assert text[2] == "The answer is 42. "
        (hit,) = stopped
        assert hit.rid == 2 and hit.matched_stop == "STOP"
        assert tok.decode(b[:hit.num_tokens]).endswith("STOP") or "STOP" in tok.decode(
            b[:hit.num_tokens])
        assert "STOP" not in tok.decode(b[:hit.num_tokens - 1])
        # Bad ids in an update: the stream carries on (unknown ids decode to nothing).
        requests.send(detokenizer_pb2.DetokenizeUpdate(rid=3, token_ids=[-1, 10**6] + a[:2],
                                                       finished=True))
        assert next(replies).deltas[0].text == tok.decode(a[:2])
        assert servers[2]._streams == 1
        requests.q.put(None)
        assert list(replies) == []
    servers[2].drain(5.0)
    assert servers[2]._streams == 0


def _spawn(service: str, model_dir: Path, port: int, metrics_port: int,
           env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "minisgl_tokenizer", service, "--metrics-port", str(metrics_port)]
    return subprocess.Popen(cmd, env={**os.environ, **env, "MINISGL_MODEL_PATH": str(model_dir)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)




def test_real_processes_env_metrics_and_sigterm(llama_dir: Path) -> None:
    ports = {name: (free_port(), free_port()) for name in ("tokenizer", "detokenizer")}
    procs = {name: _spawn(name, llama_dir, port, metrics,
                          {env_name(name, "port"): str(port), "MINISGL_LOG_LEVEL": "warning"})
             for name, (port, metrics) in ports.items()}
    try:
        for port, _ in ports.values():
            wait_for_health(f"127.0.0.1:{port}", timeout=60)
        with channel(f"127.0.0.1:{ports['tokenizer'][0]}") as ch:
            reply = tokenizer_pb2_grpc.TokenizerStub(ch).Tokenize(tokenizer_pb2.TokenizeRequest(
                items=[tokenizer_pb2.TokenizeItem(text="hello")]), timeout=10)
            assert len(reply.results[0].token_ids) > 1
        with channel(f"127.0.0.1:{ports['detokenizer'][0]}") as ch:
            requests = iter([detokenizer_pb2.DetokenizeRequest(updates=[
                detokenizer_pb2.DetokenizeUpdate(rid=9, token_ids=[40, 41], finished=True)])])
            (reply,) = list(detokenizer_pb2_grpc.DetokenizerStub(ch).Detokenize(requests,
                                                                                timeout=10))
            assert reply.deltas[0].rid == 9 and reply.deltas[0].text
        page = urllib.request.urlopen(f"http://127.0.0.1:{ports['tokenizer'][1]}/metrics",
                                      timeout=10).read().decode()
        assert 'minisgl_tokenizer_items_total{kind="text"} 1.0' in page
        page = urllib.request.urlopen(f"http://127.0.0.1:{ports['detokenizer'][1]}/metrics",
                                      timeout=10).read().decode()
        assert re.search(r'^minisgl_detokenizer_tokens_total\{model_name="[^"]+"\} 2\.0$', page,
                         re.MULTILINE), page
        # Every service counts its gRPC calls by method and code (minisgl_core.grpc_metrics).
        assert ('minisgl_grpc_server_handled_total{grpc_code="OK",grpc_method="Detokenize",'
                'grpc_service="minisgl.v1.Detokenizer"} 1.0') in page
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == {"tokenizer": 0, "detokenizer": 0}, {
        n: p.stdout.read().decode()[-2000:] for n, p in procs.items() if p.stdout}


def test_missing_model_fails_clearly(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "minisgl_tokenizer", "tokenizer", "--model",
                             str(tmp_path), "--port", "0", "--metrics-port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "tokenizer.json" in result.stderr
