"""Structured outputs under load: N concurrent requests constrained by a JSON schema vs the same
requests unconstrained, through the whole stack (OpenAI HTTP, streamed). One JSON line per mode:
throughput (output tok/s), ITL p50/p99, TTFT p50, and for the constrained run how many outputs
parse; plus one line of host-side llguidance timings on the same tokenizer.

    python -m bench.structured --model-config models/configs/Qwen3-0.6B --concurrency 256

Model: the config's shapes with dummy weights (`--load-format dummy`). Tokenizer: a synthetic
byte-level BPE with the config's vocab_size (151,936 for Qwen3): the 256 byte symbols plus random
2-8 character pieces of letters, digits, spaces and JSON punctuation (no quote or backslash, as in
real vocabularies where most pieces are word fragments). Real Qwen3 tokenizers cannot be fetched
here; mask cost depends on vocabulary size and the token trie, which this reproduces in size.
A string field keeps the constrained run from ending early (a quote is a single-byte token, rare
under random logits), so both modes generate about max_tokens per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import jsonl

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"},
                                           "text": {"type": "string"}},
          "required": ["id", "text"], "additionalProperties": False}


def make_model_dir(config_dir: str, out: Path, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(config_dir) / "config.json", out / "config.json")
    cfg = json.loads((out / "config.json").read_text())
    vocab_size = int(cfg["vocab_size"])
    rng = random.Random(seed)
    symbols = ByteLevel.alphabet()
    vocab: dict[str, int] = {}
    for s in sorted(symbols):
        vocab[s] = len(vocab)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]:,. _-"
    eos = vocab_size - 1
    while len(vocab) < eos:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        piece = piece.replace(" ", "\u0120")  # byte-level spelling of a space
        vocab.setdefault(piece, len(vocab))
    vocab["<|endoftext|>"] = eos
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "model_max_length": 4096,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out


def host_timings(tokenizer_json: str, vocab_size: int) -> dict[str, Any]:
    """llguidance on this host: tokenizer build, schema compile, mask per token."""
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, overrides={"whitespace_flexible": False})
    m = llguidance.LLMatcher(tok, grammar)
    t2 = time.perf_counter()
    mask = lnp.allocate_token_bitmask(1, tok.vocab_size)
    text = '{"id":12345,"text":"' + "abc def " * 16
    ids = tok.tokenize_str(text)
    t3 = time.perf_counter()
    for t in ids:
        lnp.fill_next_token_bitmask(m, mask, 0)
        m.consume_token(t)
    t4 = time.perf_counter()
    return {"mode": "host_llguidance", "vocab": vocab_size,
            "tokenizer_build_ms": round((t1 - t0) * 1e3, 2),
            "schema_compile_ms": round((t2 - t1) * 1e3, 3),
            "mask_us_per_token": round((t4 - t3) / max(1, len(ids)) * 1e6, 1)}


async def _one(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    stamps: list[float] = []
    text = ""
    async with client.stream("POST", url, json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for c in event.get("choices", []):
                if c.get("text"):
                    stamps.append(time.perf_counter())
                    text += c["text"]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"start": start, "stamps": stamps, "text": text, "tokens": tokens}


async def run_mode(url: str, mode: str, n: int, concurrency: int, max_tokens: int,
                   prompt_len: int, vocab: int, seed: int) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def go(i: int) -> dict[str, Any]:
            body: dict[str, Any] = {
                "prompt": [rng.randrange(256, vocab - 1) for _ in range(prompt_len)],
                "max_tokens": max_tokens, "temperature": 1.0, "seed": seed + i, "stream": True,
                "stream_options": {"include_usage": True}}
            if mode == "json_schema":
                body["guided_json"] = SCHEMA
            else:
                body["ignore_eos"] = True
            async with sem:
                return await _one(client, f"{url}/v1/completions", body)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(i) for i in range(n)))
        wall = time.perf_counter() - t0
    itls = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    ttfts = [r["stamps"][0] - r["start"] for r in results if r["stamps"]]
    tokens = sum(r["tokens"] for r in results)
    out: dict[str, Any] = {
        "mode": mode, "requests": n, "concurrency": concurrency, "max_tokens": max_tokens,
        "output_tokens": tokens, "seconds": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1),
        "itl_ms_p50": round(statistics.median(itls) * 1e3, 3) if itls else None,
        "itl_ms_p99": round(statistics.quantiles(itls, n=100)[98] * 1e3, 3)
        if len(itls) > 100 else None,
        "ttft_ms_p50": round(statistics.median(ttfts) * 1e3, 1) if ttfts else None}
    if mode == "json_schema":
        # Outputs cut by max_tokens are JSON prefixes; finished ones must parse.
        out["complete_valid"] = sum(1 for r in results if _valid(r["text"]))
    return out


def _valid(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--model-config", default="models/configs/Qwen3-0.6B")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--worker-args", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="append the JSON lines to this file")
    args = p.parse_args()

    import shlex

    from minisgl.launcher import Stack, StackConfig
    from minisgl_core.ports import free_port

    model_dir = make_model_dir(args.model_config, Path(tempfile.mkdtemp()) / "model")
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    records = [host_timings(str(model_dir / "tokenizer.json"), vocab)]
    print(json.dumps(records[0]), flush=True)
    stack = Stack(StackConfig(
        model_path=str(model_dir), http_port=free_port(), grpc_port=free_port(),
        internal_ports=dict.fromkeys(("worker", "tokenizer", "detokenizer", "scheduler"), 0),
        extra_args={"worker": ["--load-format", "dummy", *shlex.split(args.worker_args)]},
        log_dir=Path("/tmp/minisgl-bench-logs"), log_level="warning",
        startup_timeout=900)).start()
    try:
        # Warm-up: CUDA graphs, the grammar compile, connection set-up.
        for mode in ("unconstrained", "json_schema"):
            asyncio.run(run_mode(stack.http_url, mode, 8, 8, 16, args.prompt_len, vocab, 99))
        for mode in ("unconstrained", "json_schema", "unconstrained"):
            rec = asyncio.run(run_mode(stack.http_url, mode, args.num_requests, args.concurrency,
                                       args.max_tokens, args.prompt_len, vocab, args.seed))
            records.append(rec)
            print(json.dumps(rec), flush=True)
    finally:
        stack.stop()
    jsonl.append(args.json, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
