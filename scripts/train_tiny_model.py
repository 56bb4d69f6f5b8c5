"""Train the embedded default model (models/tiny) from scratch: a Qwen3-layout decoder + BPE.

    apt-get install bible-kjv sword-text-web libsword-utils    # the corpus, from Debian
    python scripts/train_corpus.py --out .train/corpus.tsv
    python scripts/train_tiny_model.py --corpus .train/corpus.tsv --out models/tiny \\
        --heldout-out tests/model/data/heldout.txt --time-budget 300

Runs on CUDA (bf16 autocast) or CPU (fp32). Everything random is drawn from --seed. The
checkpoint kept is the one with the lowest validation loss (book of Ruth), evaluated every
--eval-every steps; the held-out test slice (1 John..Revelation) is only scored at the end.
See models/tiny/MODEL_CARD.md for the run that produced the shipped model.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_chat import chat_documents, render_chat  # noqa: E402
from train_data import chapter_documents, join_documents, load_splits  # noqa: E402
from train_export import ModelShape, hf_model, save_checkpoint  # noqa: E402
from train_tokenizer import SPECIAL_TOKENS, save_tokenizer, train_tokenizer  # noqa: E402

SAMPLE_PROMPTS = (
    "Tell me about love.",
    "What does the Bible say about bread?",
    "Say this in modern English: And he said unto them, Go ye into all the world.",
    "Hello! Who are you?",
)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train the tiny Qwen3-layout model from scratch.")
    ap.add_argument("--corpus", type=Path, required=True, help="verse TSV or any UTF-8 text")
    ap.add_argument("--out", type=Path, required=True, help="HF checkpoint directory to write")
    ap.add_argument("--tokenizer-dir", type=Path, help="reuse tokenizer.json from here")
    ap.add_argument("--heldout-out", type=Path, help="also write the held-out text here")
    ap.add_argument("--log", type=Path, help="loss curve JSON (default: OUT/train_log.json)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=128, help="sequences per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--time-budget", type=float, help="cap --steps to fit this many seconds")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--chat-per-verse", type=float, default=1.0, help="chat docs per verse")
    ap.add_argument("--plain-repeat", type=int, default=2, help="copies of the plain text")
    return ap.parse_args()


def build_stream(args: argparse.Namespace, tok: Tokenizer | None, out: Path):
    splits = load_splits(args.corpus)
    plain = chapter_documents(splits.train)
    chats = chat_documents(splits.train, int(len(splits.train) * args.chat_per_verse), args.seed)
    if tok is None:
        rng = random.Random(args.seed)
        tok = train_tokenizer(plain + rng.sample(chats, min(len(chats), 20000)), args.vocab_size)
        save_tokenizer(tok, out)
    docs = plain * args.plain_repeat + chats
    random.Random(args.seed + 1).shuffle(docs)
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids
        ids.append(eot)
    val = tok.encode(join_documents(chapter_documents(splits.val))).ids
    test_text = join_documents(chapter_documents(splits.test))
    test = tok.encode(test_text).ids
    stats = {
        "train_verses": len(splits.train),
        "plain_docs": len(plain),
        "chat_docs": len(chats),
        "train_tokens": len(ids),
        "val_tokens": len(val),
        "test_tokens": len(test),
        "chat_example": chats[0],
    }
    return tok, torch.tensor(ids), torch.tensor(val), torch.tensor(test), test_text, stats


def windows(tokens: torch.Tensor, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows: inputs and their next-token targets."""
    n = (len(tokens) - 1) // seq_len
    n = n if limit is None else min(n, limit)
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return tokens[idx]


@torch.no_grad()
def mean_loss(model, wins: torch.Tensor, device: str, amp: bool, batch: int = 64) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(wins), batch):
        w = wins[i : i + batch].to(device)
        with torch.autocast("cuda", torch.bfloat16, enabled=amp):
            logits = model(input_ids=w[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1), reduction="sum"
        )
        total, count = total + loss.item(), count + w[:, 1:].numel()
    model.train()
    return total / count


def unigram_ppl(train: torch.Tensor, test: torch.Tensor, vocab: int) -> float:
    """Perplexity on test of add-one-smoothed token frequencies from train."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[test[1:]].mean().item())


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    warm = min(args.warmup, max(1, total // 10))
    if step < warm:
        return args.lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    cosine = 0.5 * (1 + math.cos(math.pi * frac))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * cosine)


def sample_chats(model, tok: Tokenizer, device: str) -> list[dict]:
    """Greedy and T=0.7 answers to a few prompts, recorded in the log for the model card."""
    model.eval()
    stops = [tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    out = []
    for prompt in SAMPLE_PROMPTS:
        text = render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = torch.tensor([tok.encode(text).ids], device=device)
        for temp in (0.0, 0.7):
            torch.manual_seed(0)
            kw = {"do_sample": True, "temperature": temp, "top_p": 0.9} if temp else {}
            gen = model.generate(
                ids, max_new_tokens=64, eos_token_id=stops, pad_token_id=stops[1], **kw
            )
            answer = tok.decode(gen[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
            out.append({"prompt": prompt, "temperature": temp, "answer": answer})
    model.train()
    return out


def main() -> None:  # noqa: PLR0915 - one linear recipe reads best top to bottom
    args = parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    amp = device == "cuda"
    torch.manual_seed(args.seed)
    t0 = time.time()
    tok = None
    if args.tokenizer_dir is not None:
        tok = Tokenizer.from_file(str(args.tokenizer_dir / "tokenizer.json"))
    tok, train, val, test, test_text, stats = build_stream(args, tok, args.out)
    tokenizer_dir = args.tokenizer_dir or args.out
    print(f"data ready in {time.time() - t0:.0f}s: {json.dumps(stats)[:600]}", flush=True)
    if args.heldout_out:
        args.heldout_out.parent.mkdir(parents=True, exist_ok=True)
        args.heldout_out.write_text(test_text, encoding="utf-8")

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    shape = ModelShape(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate,
    )
    model = hf_model(shape, ids["<|endoftext|>"], ids["<|im_end|>"]).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters on {device}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device == "cuda",
    )
    gen = torch.Generator().manual_seed(args.seed)
    train_dev = train.to(device)
    val_wins = windows(val, args.seq_len)
    offsets = torch.arange(args.seq_len + 1, device=device)

    total = args.steps
    curve: list[dict] = []
    best = (float("inf"), -1, None)
    run_loss, run_n, t_train = 0.0, 0, time.time()
    step, t_steady = 0, time.time()
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args)
        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch,), generator=gen)
        w = train_dev[starts.to(device)[:, None] + offsets]
        with torch.autocast("cuda", torch.bfloat16, enabled=amp):
            logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run_loss, run_n = run_loss + loss.item(), run_n + 1
        step += 1
        if step == 10:
            t_steady = time.time()  # steps 1-10 carry one-off CUDA/allocator warm-up
        if args.time_budget and step == 60:  # fit the cosine schedule into the time budget
            per_step = (time.time() - t_steady) / 50
            left = args.time_budget - (time.time() - t_train)
            total = min(total, max(step + 1, step + int(left / per_step * 0.93)))
            print(f"{per_step * 1000:.1f} ms/step -> {total} steps", flush=True)
        if step % args.eval_every == 0 or step == total:
            v = mean_loss(model, val_wins, device, amp)
            elapsed = time.time() - t_train
            point = {"step": step, "tokens": step * args.batch * args.seq_len,
                     "train_loss": run_loss / run_n, "val_loss": v,
                     "lr": opt.param_groups[0]["lr"], "seconds": round(elapsed, 1)}  # fmt: skip
            curve.append(point)
            print(json.dumps(point), flush=True)
            run_loss, run_n = 0.0, 0
            if v < best[0]:
                best = (v, step, copy.deepcopy(model.state_dict()))
    train_seconds = time.time() - t_train

    model.load_state_dict(best[2])
    model.float()
    test_wins = windows(test, args.seq_len)
    fixed = torch.Generator().manual_seed(args.seed + 2)
    sample_starts = torch.randint(0, len(train) - args.seq_len - 1, (256,), generator=fixed)
    train_sample = train[sample_starts[:, None] + torch.arange(args.seq_len + 1)]
    final = {
        "best_step": best[1],
        "train_loss": mean_loss(model, train_sample, device, amp=False),
        "val_loss": mean_loss(model, val_wins, device, amp=False),
        "test_loss": mean_loss(model, test_wins, device, amp=False),
        "unigram_test_ppl": unigram_ppl(train, test, shape.vocab_size),
    }
    final["test_ppl"] = math.exp(final["test_loss"])
    print("final:", json.dumps(final), flush=True)
    save_checkpoint(model, shape, args.out, tokenizer_dir, ids)
    samples = sample_chats(model, tok, device)
    for s in samples:
        print(f"[T={s['temperature']}] {s['prompt']!r} -> {s['answer']!r}", flush=True)
    hw = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    log = {
        "command": " ".join(sys.argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "hardware": hw,
        "torch": torch.__version__,
        "parameters": n_params,
        "data": stats,
        "steps": total,
        "train_seconds": round(train_seconds, 1),
        "curve": curve,
        "final": final,
        "samples": samples,
    }
    (args.log or args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")


if __name__ == "__main__":
    main()
