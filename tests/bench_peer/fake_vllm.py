"""A stand-in for a vLLM site folder, for CPU tests of bench.peer: `vllm/__init__.py` whose `LLM`
records its keyword arguments, every generate call's prompts and max_tokens, and the NVLS and
sampler variables of its environment into $FAKE_VLLM_LOG (JSON lines), and answers each prompt
with max_tokens ids; and `vllm.entrypoints.openai.api_server`, an HTTP server of the endpoints
bench.peer.serving uses (/health, /v1/models, streamed /v1/completions carrying token ids and empty
text as vLLM without a tokenizer does, /metrics with prefix-cache counters: half of every prompt
counted a hit), logging each completion body. It computes nothing: the tests check what the peer
sends, not vLLM."""

from __future__ import annotations

from pathlib import Path

SOURCE = '''
import json, os
from types import SimpleNamespace

__version__ = "0.0-fake"
_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
        "VLLM_USE_FLASHINFER_SAMPLER", "PYTHONPATH",
        "VLLM_ENABLE_V1_MULTIPROCESSING")


def _log(rec):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(rec) + "\\n")


class SamplingParams:
    def __init__(self, temperature=1.0, ignore_eos=False, max_tokens=16):
        self.temperature, self.ignore_eos, self.max_tokens = temperature, ignore_eos, max_tokens


class LLM:
    def __init__(self, **kwargs):
        _log({"init": kwargs, "env": {k: os.environ.get(k) for k in _ENV}})
        sched = SimpleNamespace(max_num_batched_tokens=kwargs.get("max_num_batched_tokens", 8192))
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=sched),
                                          engine_core=SimpleNamespace(shutdown=lambda: None))

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        _log({"prompts": [p["prompt_token_ids"] for p in prompts],
              "max_tokens": [sp.max_tokens for sp in params]})
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], num_cached_tokens=0,
                                outputs=[SimpleNamespace(token_ids=[7] * sp.max_tokens)])
                for p, sp in zip(prompts, params)]
'''


SERVER = r'''
import argparse, asyncio, json, os

p = argparse.ArgumentParser()
p.add_argument("--host")
p.add_argument("--port", type=int)
args, _ = p.parse_known_args()
hits = queries = 0


async def handle(reader, writer):
    global hits, queries
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    method, path = head.split(" ")[:2]
    length = next((int(line.split(":")[1]) for line in head.split("\r\n")
                   if line.lower().startswith("content-length:")), 0)
    body = json.loads(await reader.readexactly(length)) if length else None

    def reply(data, kind="application/json"):
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                     .encode() + data)

    if path == "/health":
        reply(b"")
    elif path == "/v1/models":
        reply(json.dumps({"data": [{"id": "fake"}]}).encode())
    elif path == "/metrics":
        reply((f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}\n'
               f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}\n').encode(),
              "text/plain")
    else:
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"body": body}) + "\n")
        queries += len(body["prompt"])
        hits += len(body["prompt"]) // 2
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        events = [{"choices": [{"index": 0, "text": "", "token_ids": [7]}]}
                  for _ in range(body["max_tokens"])]
        events.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
        for event in [*(f"data: {json.dumps(e)}\n\n" for e in events), "data: [DONE]\n\n"]:
            data = event.encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


async def main():
    server = await asyncio.start_server(handle, args.host, args.port)
    async with server:
        await server.serve_forever()

asyncio.run(main())
'''


def make_site(root: Path) -> Path:
    (root / "vllm" / "entrypoints" / "openai").mkdir(parents=True, exist_ok=True)
    (root / "vllm" / "__init__.py").write_text(SOURCE)
    for pkg in ("entrypoints", "entrypoints/openai"):
        (root / "vllm" / pkg / "__init__.py").write_text("")
    (root / "vllm" / "entrypoints" / "openai" / "api_server.py").write_text(SERVER)
    (root / "vllm-0.0.dist-info").mkdir(exist_ok=True)
    return root
