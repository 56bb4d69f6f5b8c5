"""Scripted tokenizer, detokenizer and scheduler services for gateway tests that need what the real
stack cannot do on demand: break a stream mid-request, refuse with OVERLOADED, count aborts.

They speak the real protos over real gRPC on loopback; only the "model" is scripted: a byte-level
vocabulary (id = byte + 3; 1 BOS, 2 EOS) and a text generator (greedy: a fixed sentence; seeded:
reproducible letters). The gateway's end-to-end behaviour against the real services lives in the
other test files."""

from __future__ import annotations

import random
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

BOS, EOS, OFFSET = 1, 2, 3
VOCAB = 256 + OFFSET
MAX_MODEL_LEN = 256
GREEDY_TEXT = "The quick brown fox jumps over the lazy dog. "


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


def decode(ids: list[int]) -> bytes:
    return bytes(i - OFFSET for i in ids if i >= OFFSET)


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self) -> None:
        self.decode_calls = 0
        self.tokenize_calls = 0

    def Tokenize(self, request, context):  # noqa: N802
        self.tokenize_calls += 1
        limit = request.max_prompt_tokens or MAX_MODEL_LEN
        results = []
        for item in request.items:
            which = item.WhichOneof("input")
            if which == "text":
                ids = [BOS] + encode(item.text)
            elif which == "token_ids":
                ids = list(item.token_ids.ids)
                if any(not 0 <= t < VOCAB for t in ids):
                    results.append(tokenizer_pb2.TokenizeResult(error=common_pb2.Error(
                        code=common_pb2.ERROR_CODE_INVALID_ARGUMENT, message="bad token id")))
                    continue
            else:
                text = "".join(f"{m.role}: {m.content}\n" for m in item.chat.messages)
                ids = [BOS] + encode(text + "assistant: ")
            if len(ids) > limit:
                results.append(tokenizer_pb2.TokenizeResult(error=common_pb2.Error(
                    code=common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED,
                    message=f"the prompt has {len(ids)} tokens, more than {limit}")))
                continue
            results.append(tokenizer_pb2.TokenizeResult(token_ids=ids))
        return tokenizer_pb2.TokenizeResponse(results=results)

    def GetTokenizerInfo(self, request, context):  # noqa: N802
        return tokenizer_pb2.GetTokenizerInfoResponse(
            model_name="fake-model", vocab_size=VOCAB, eos_token_ids=[EOS],
            max_model_len=MAX_MODEL_LEN, has_chat_template=True)

    def DecodeTokens(self, request, context):  # noqa: N802
        self.decode_calls += 1
        return tokenizer_pb2.DecodeTokensResponse(
            texts=[decode([t]).decode("utf-8", "replace") for t in request.token_ids])


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    sampling: common_pb2.SamplingParams
    produced: int = 0
    rng: random.Random = field(default_factory=random.Random)
    aborted: bool = False
    first: bool = True


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """One token per request per step; prompts containing "OVERLOAD" are refused."""

    def __init__(self, step_s: float = 0.01) -> None:
        self.step_s = step_s
        self.lock = threading.Lock()
        self.running: dict[int, _Req] = {}
        self.connects = 0
        self.aborts_seen: list[int] = []
        self.submits_per_message: list[int] = []
        self.break_now = threading.Event()

    def _next_token(self, req: _Req) -> int:
        sp = req.sampling
        if sp.HasField("temperature") and sp.temperature == 0:
            return encode(GREEDY_TEXT[req.produced % len(GREEDY_TEXT)])[0]
        return encode(req.rng.choice("abcdefghij "))[0]

    def _read(self, requests, mine: set[int], closed: threading.Event) -> None:
        try:
            for message in requests:
                with self.lock:
                    self.submits_per_message.append(len(message.submits))
                    for item in message.submits:
                        sp = item.sampling
                        req = _Req(item.rid, list(item.input_ids), sp)
                        if sp.HasField("seed"):
                            req.rng.seed(sp.seed)
                        self.running[item.rid] = req
                        mine.add(item.rid)
                    for rid in message.aborts:
                        self.aborts_seen.append(rid)
                        if rid in self.running:
                            self.running[rid].aborted = True
        except grpc.RpcError:
            pass
        finally:
            closed.set()

    def Connect(self, request_iterator, context):  # noqa: N802
        self.connects += 1
        mine: set[int] = set()
        closed = threading.Event()
        threading.Thread(target=self._read, args=(request_iterator, mine, closed),
                         daemon=True).start()
        try:
            while context.is_active() and not closed.is_set():
                if self.break_now.is_set():
                    self.break_now.clear()
                    context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler crashed (test)")
                time.sleep(self.step_s)
                updates = self._step(mine)
                if updates:
                    yield scheduler_pb2.ConnectResponse(updates=updates)
        finally:
            with self.lock:  # a dropped stream aborts everything it submitted
                for rid in mine:
                    self.running.pop(rid, None)

    def _step(self, mine: set[int]) -> list[scheduler_pb2.TokenUpdate]:
        updates = []
        with self.lock:
            for rid in list(mine):
                req = self.running.get(rid)
                if req is None:
                    mine.discard(rid)
                    continue
                update = scheduler_pb2.TokenUpdate(rid=rid, prompt_tokens=len(req.prompt))
                if b"OVERLOAD" in decode(req.prompt):
                    update.finish_reason = common_pb2.FINISH_REASON_ERROR
                    update.error.code = common_pb2.ERROR_CODE_OVERLOADED
                    update.error.message = "queue full (test)"
                elif req.aborted:
                    update.finish_reason = common_pb2.FINISH_REASON_ABORT
                else:
                    token = self._next_token(req)
                    req.produced += 1
                    update.token_ids.append(token)
                    if req.sampling.logprobs:
                        update.logprobs.append(-0.25)
                        k = req.sampling.top_logprobs
                        update.top_logprobs.append(common_pb2.TopLogprobs(
                            token_ids=[token + i for i in range(k)],
                            logprobs=[-0.25 - i for i in range(k)]))
                    limit = req.sampling.max_tokens or 16
                    if req.produced >= limit:
                        update.finish_reason = common_pb2.FINISH_REASON_LENGTH
                if update.finish_reason:
                    del self.running[rid]
                    mine.discard(rid)
                updates.append(update)
        return updates

    def GetLoad(self, request, context):  # noqa: N802
        with self.lock:
            return scheduler_pb2.GetLoadResponse(running_requests=len(self.running))


class FakeDetokenizer(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self) -> None:
        self.states: dict[int, tuple[bytearray, list[str], int, int]] = {}
        self.break_now = threading.Event()

    def Detokenize(self, request_iterator, context):  # noqa: N802
        # Per stream: rid -> (bytes so far, stop strings, characters already sent, tokens).
        states: dict[int, list] = {}
        self.states = states  # type: ignore[assignment]
        for message in request_iterator:
            if self.break_now.is_set():
                self.break_now.clear()
                context.abort(grpc.StatusCode.UNAVAILABLE, "detokenizer crashed (test)")
            deltas = []
            for u in message.updates:
                state = states.setdefault(u.rid, [bytearray(), list(u.stop.stop), 0, 0])
                delta = detokenizer_pb2.TextDelta(rid=u.rid)
                for t in u.token_ids:
                    state[0] += decode([t])
                    state[3] += 1
                    text = state[0].decode("utf-8", "ignore")
                    hits = [(text.find(s), s) for s in state[1] if s in text]
                    if hits:
                        pos, stop = min(hits)
                        delta.text += text[state[2]:pos]
                        delta.stopped, delta.matched_stop = True, stop
                        delta.num_tokens = state[3]
                        state[2] = pos
                        break
                if not delta.stopped:
                    text = state[0].decode("utf-8", "ignore")
                    # Hold back a tail that may be the start of a stop string.
                    hold = max([k for s in state[1] for k in range(1, len(s))
                                if text.endswith(s[:k])] + [0])
                    end = len(text) - (0 if u.finished else hold)
                    delta.text, state[2] = text[state[2]:end], max(state[2], end)
                if u.finished:
                    states.pop(u.rid, None)
                deltas.append(delta)
            yield detokenizer_pb2.DetokenizeResponse(deltas=deltas)


class FakeUpstreams:
    """The three services on free loopback ports, each with grpc.health.v1."""

    def __init__(self, step_s: float = 0.01) -> None:
        self.tokenizer = FakeTokenizer()
        self.scheduler = FakeScheduler(step_s)
        self.detokenizer = FakeDetokenizer()
        self.servers: dict[str, grpc.Server] = {}
        self.ports: dict[str, int] = {}

    def start(self) -> FakeUpstreams:
        adders = {
            "tokenizer": (tokenizer_pb2_grpc.add_TokenizerServicer_to_server, self.tokenizer),
            "detokenizer": (detokenizer_pb2_grpc.add_DetokenizerServicer_to_server,
                            self.detokenizer),
            "scheduler": (scheduler_pb2_grpc.add_SchedulerServicer_to_server, self.scheduler),
        }
        for name, (add, servicer) in adders.items():
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
            add(servicer, server)
            hs = health.HealthServicer()
            hs.set("", health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(hs, server)
            self.ports[name] = server.add_insecure_port("127.0.0.1:0")
            server.start()
            self.servers[name] = server
        return self

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop(0)
