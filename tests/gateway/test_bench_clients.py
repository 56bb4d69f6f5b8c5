"""bench.serving's HTTP clients against the running stack: the lean SSE client
(bench/common/sse_client.py) must see exactly the events httpx sees, errors must come out as errors, and a
small load through either client must count every token (the GPU rows in docs/benchmarks.md rest
on these figures)."""

from __future__ import annotations

import asyncio
import functools
import types

import httpx
import openai
import pytest

from bench import serving
from bench.common.sse_client import HttpError, stream_events

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model(gw_stack) -> str:
    client = openai.OpenAI(base_url=f"{gw_stack.http_url}/v1", api_key="unused", max_retries=0)
    return client.models.list().data[0].id


async def _collect_lean(url: str, body: dict) -> list[dict]:
    return [event async for event in stream_events(url, "/v1/completions", body)]


async def _collect_httpx(url: str, body: dict) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as client:
        return [event async for event in serving.httpx_events(client, url, body)]


def _strip_ids(events: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in ("id", "created")} for e in events]


def test_lean_client_sees_what_httpx_sees(gw_stack, model: str) -> None:
    body = {"model": model, "prompt": "In the beginning God created", "max_tokens": 12,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    lean = asyncio.run(_collect_lean(gw_stack.http_url, body))
    via_httpx = asyncio.run(_collect_httpx(gw_stack.http_url, body))
    assert len(lean) > 2 and _strip_ids(lean) == _strip_ids(via_httpx)
    whole = openai.OpenAI(base_url=f"{gw_stack.http_url}/v1", api_key="unused").completions.create(
        model=model, prompt=body["prompt"], max_tokens=12, temperature=0)
    text = "".join(e["choices"][0]["text"] for e in lean if e.get("choices"))
    assert text == whole.choices[0].text
    assert lean[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens


def test_lean_client_raises_on_an_error_status(gw_stack) -> None:
    body = {"model": "no-such-model", "prompt": "x", "max_tokens": 2, "stream": True}
    with pytest.raises(HttpError) as err:
        asyncio.run(_collect_lean(gw_stack.http_url, body))
    assert 400 <= err.value.status < 500 and "no-such-model" in str(err.value)


@pytest.mark.parametrize("http_client", ["lean", "httpx"])
def test_load_counts_every_token(gw_stack, http_client: str) -> None:
    args = types.SimpleNamespace(protocol="http", workload="random", concurrency=4,
                                 request_rate=0.0, client_procs=1, http_client=http_client)
    workload = [([11 + i, 22, 33, 44 + i], 3 + i) for i in range(6)]
    results, start, end = asyncio.run(serving._drive(args, workload, gw_stack.http_url, ""))
    assert [r.error for r in results] == [""] * 6
    assert [r.output_tokens for r in results] == [n for _, n in workload]  # ignore_eos
    assert all(r.ok and 0 < r.ttft <= r.latency for r in results) and start < end


def test_load_counts_a_failed_request_as_an_error(gw_stack) -> None:
    events = functools.partial(stream_events, gw_stack.http_url, "/v1/completions")
    res = asyncio.run(serving.http_request(events, "no-such-model", [1, 2, 3], 4))
    assert not res.ok and "HTTP 4" in res.error and "before the first token" in res.error
