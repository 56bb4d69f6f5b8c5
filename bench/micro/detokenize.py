"""Detokenizer throughput: 256 concurrent requests, one batched update per scheduler step.

    python -m bench.micro.detokenize [--model models/tiny] [--streams 256] [--steps 400]

Two measurements: the plain `Detokenizer` class in this process, and the same traffic through the
gRPC `Detokenize` bidirectional stream of a real detokenizer process on loopback (one message per
step with all requests' new tokens, as the gateway sends them, lock-step). A quarter of the requests
carry stop strings that never match, so matching and hold-back run on every step. Target: >= 200,000
tokens/s per process. Without --model, a byte-level BPE tokenizer is trained here on multilingual
text.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Read when a tokenizer first runs in parallel (not at import), here and in the child services.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]
TEXT = [
    "The scheduler batches every running request into one step, and the detokenizer turns each "
    "step's new tokens into text for all of them at once. ",
    "Les modèles de langue génèrent du texte un jeton à la fois; ça demande de la patience. ",
    "大型语言模型一次生成一个词元，解码器必须等待完整的字符。日本語の文章も混ぜます。",
    "Emoji keep byte-level decoders honest 🎉🚀👍🏽 👨‍👩‍👧 ✅ — und Umlaute: äöüß. ",
    "def step(batch):\n    return [req.next_token() for req in batch]  # one line of code\n",
]


def load_tokenizer(model: str | None) -> tuple[Tokenizer, dict[int, str], str]:
    if model:  # "" trains one, as when models/tiny is missing
        from minisgl_tokenizer import ModelTokenizer

        m = ModelTokenizer.load(model)
        return m.tokenizer, m.special_text, Path(model).name
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT * 50, trainers.BpeTrainer(
        vocab_size=4000, special_tokens=["<|endoftext|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    special = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return tok, special, "trained byte-level BPE (4k vocab)"


def make_streams(tok: Tokenizer, n: int, steps: int) -> list[list[int]]:
    rng = random.Random(0)
    streams = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < steps:
            ids += tok.encode(rng.choice(TEXT), add_special_tokens=False).ids
        start = rng.randrange(0, len(ids) - steps + 1)
        streams.append(ids[start:start + steps])
    return streams


def bench_class(tok: Tokenizer, special: dict[int, str], streams: list[list[int]]) -> float:
    from minisgl_tokenizer import Detokenizer, DetokenizeUpdate, StopConditions

    detok = Detokenizer(tok, special)
    stop = StopConditions(stop=("NEVER-MATCHES", "\n\n\n\n"))
    steps = len(streams[0])
    start = time.perf_counter()
    for step in range(steps):
        detok.step([DetokenizeUpdate(rid, ids[step:step + 1],
                                     (stop if rid % 4 == 0 else None) if step == 0 else None,
                                     finished=step == steps - 1)
                    for rid, ids in enumerate(streams)])
    elapsed = time.perf_counter() - start
    assert detok.active == 0
    return len(streams) * steps / elapsed


def start_server(tok: Tokenizer, model: str | None, workdir: Path) -> tuple[subprocess.Popen, int]:
    """A real `python -m minisgl_tokenizer detokenizer` process, as deployed."""
    if not model:  # the trained tokenizer, saved as a minimal model directory
        model = str(workdir)
        tok.save(str(workdir / "tokenizer.json"))
        (workdir / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "minisgl_tokenizer", "detokenizer", "--model",
                             model, "--port", str(port), "--metrics-port", "0",
                             "--log-level", "warning"])
    from minisgl_core.serving import wait_for_health

    for _ in range(120):
        if proc.poll() is not None:
            raise RuntimeError(f"the detokenizer exited with code {proc.returncode}")
        try:
            wait_for_health(f"127.0.0.1:{port}", timeout=1)
            return proc, port
        except TimeoutError:
            continue
    proc.kill()
    raise TimeoutError("the detokenizer did not become healthy")


def bench_grpc(port: int, streams: list[list[int]], pipelined: bool) -> float:
    """Lock-step: send a step, wait for its text (a gateway at low load; bound by the round trip).
    Pipelined: the steps go out as fast as the stream takes them (a backlog: bound by the server).
    """
    from minisgl_core.proto.minisgl.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc
    from minisgl_core.serving import channel

    steps = len(streams[0])
    stop = common_pb2.StopConditions(stop=["NEVER-MATCHES", "\n\n\n\n"])
    # Messages are built before the clock starts: the gateway has them as scheduler output anyway.
    messages = [detokenizer_pb2.DetokenizeRequest(updates=[
        detokenizer_pb2.DetokenizeUpdate(rid=rid, token_ids=ids[step:step + 1],
                                         stop=stop if step == 0 and rid % 4 == 0 else None,
                                         finished=step == steps - 1)
        for rid, ids in enumerate(streams)]) for step in range(steps)]
    outbox: queue.Queue = queue.Queue()

    def requests():
        while (m := outbox.get()) is not None:
            yield m

    with channel(f"127.0.0.1:{port}") as ch:
        replies = detokenizer_pb2_grpc.DetokenizerStub(ch).Detokenize(requests())
        start = time.perf_counter()
        for message in messages:
            outbox.put(message)
            if not pipelined:
                assert len(next(replies).deltas) == len(streams)
        if pipelined:
            for _ in messages:
                assert len(next(replies).deltas) == len(streams)
        elapsed = time.perf_counter() - start
        outbox.put(None)
        list(replies)
    return len(streams) * steps / elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_model = ROOT / "models" / "tiny"
    p.add_argument("--model", default=str(default_model) if (default_model / "tokenizer.json")
                   .exists() else "", help="model directory with tokenizer.json ('': train one)")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args()

    tok, special, name = load_tokenizer(args.model)
    streams = make_streams(tok, args.streams, args.steps)
    bench_class(tok, special, streams[:16])  # warm-up
    cls = max(bench_class(tok, special, streams) for _ in range(args.repeats))
    with tempfile.TemporaryDirectory() as workdir:
        proc, port = start_server(tok, args.model, Path(workdir))
        try:
            bench_grpc(port, streams[:16], False)  # warm-up
            lockstep = max(bench_grpc(port, streams, False) for _ in range(args.repeats))
            pipelined = max(bench_grpc(port, streams, True) for _ in range(args.repeats))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    record = {"tokenizer": name, "streams": args.streams, "steps": args.steps,
              "class_tokens_per_s": round(cls), "grpc_lockstep_tokens_per_s": round(lockstep),
              "grpc_pipelined_tokens_per_s": round(pipelined), "target_tokens_per_s": 200_000}
    print(json.dumps(record))
    print(f"{args.streams} concurrent requests, 1 token each per step, best of {args.repeats}:\n"
          f"  Detokenizer class:            {cls:>10,.0f} tokens/s\n"
          f"  gRPC stream, lock-step:       {lockstep:>10,.0f} tokens/s\n"
          f"  gRPC stream, pipelined:       {pipelined:>10,.0f} tokens/s")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
