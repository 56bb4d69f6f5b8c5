"""One streamed request against the gateway, timed: TTFT, inter-token gaps, output tokens.
Shared by the serving and routing benchmarks (OpenAI SSE over HTTP, or the public gRPC API)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field


@dataclass
class Result:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


async def httpx_events(client, url: str, body: dict) -> AsyncIterator[dict]:
    """sse_client.stream_events through httpx (`--http-client httpx`: the `openai` client's
    transport, ~66 µs of client CPU a token)."""
    from bench.common.sse_client import HttpError

    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise HttpError(reply.status_code, await reply.aread())
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            yield json.loads(line[6:])


async def http_request(events: Callable[[dict], AsyncIterator[dict]], model: str,
                       prompt: list[int], max_tokens: int) -> Result:
    # return_token_ids: vLLM run without a tokenizer (bench.peer.serving) streams empty text and
    # the ids only when asked; the gateway ignores the key. A chunk is a token if it carries either.
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.6, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    start = time.perf_counter()
    last, res = start, Result(ok=False)
    try:
        async for chunk in events(body):
            if "error" in chunk:  # the gateway ends a failed stream with an OpenAI error event
                raise RuntimeError(f"error event: {chunk['error']}")
            if chunk.get("usage"):
                res.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and (chunk["choices"][0].get("text")
                                         or chunk["choices"][0].get("token_ids")):
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
        res.ok, res.latency = True, time.perf_counter() - start
    except Exception as exc:  # a benchmark counts errors; it does not stop on them
        res.error = (f"{exc!r} after {time.perf_counter() - start:.2f}s, "
                     f"{'after' if res.ttft else 'before'} the first token")
    return res


async def grpc_request(stub, pb, prompt: list[int], max_tokens: int,
                       temperature: float = 0.6) -> Result:
    from minisgl_core.proto.minisgl.v1 import common_pb2

    request = pb.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                           ignore_eos=True))
    start = time.perf_counter()
    last, res = start, Result(ok=False)
    try:
        async for msg in stub.GenerateStream(request):
            now = time.perf_counter()
            if msg.choices and msg.choices[0].token_ids:
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
            if msg.HasField("usage") and msg.usage.completion_tokens:
                res.output_tokens = msg.usage.completion_tokens
        res.ok, res.latency = True, time.perf_counter() - start
    except Exception as exc:
        res.error = repr(exc)
    return res
