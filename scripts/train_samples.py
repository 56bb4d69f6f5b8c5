"""Score and sample a trained tiny model with HF transformers on CPU (numbers for the model card).

    python scripts/train_samples.py --model models/tiny --heldout tests/model/data/heldout.txt

Prints the fp32 perplexity over every 256-token window of the held-out text, the unigram
baseline fitted on that text itself, chat answers (greedy, and sampled with the defaults of
generation_config.json) and the wall time of 64 greedy tokens.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from pathlib import Path

import torch

PROMPTS = (
    "Tell me about love.",
    "Give me a verse about water.",
    "What should I eat for dinner?",
    "Hello! Who are you?",
    "Say this in modern English: Thou shalt not steal.",
    "Finish this verse: In the beginning God",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("models/tiny"))
    ap.add_argument("--heldout", type=Path, default=Path("tests/model/data/heldout.txt"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    ids = tok(args.heldout.read_text(), add_special_tokens=False).input_ids
    n = (len(ids) - 1) // 256
    wins = torch.tensor([ids[i * 256 : i * 256 + 257] for i in range(n)])
    nll = 0.0
    with torch.no_grad():
        for b in wins.split(16):
            logits = model(input_ids=b[:, :-1]).logits
            nll += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1), reduction="sum"
            ).item()
    counts = Counter(ids)
    unigram = math.exp(-sum(c / len(ids) * math.log(c / len(ids)) for c in counts.values()))
    print(f"held-out: {len(ids)} tokens, {n} windows, ppl {math.exp(nll / (n * 256)):.2f}, "
          f"unigram ppl {unigram:.1f}")  # fmt: skip

    for prompt in PROMPTS:
        enc = tok.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        # Plain greedy, then the defaults of generation_config.json (T=0.7, top-p 0.9, top-k 40,
        # repetition penalty 1.1), which generate() applies to whatever is not passed.
        for name, kw in (("greedy", {"do_sample": False, "repetition_penalty": 1.0}),
                         ("default", {})):  # fmt: skip
            torch.manual_seed(1)
            out = model.generate(**enc, max_new_tokens=64, **kw)
            answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            print(f"[{name}] {prompt} -> {answer}")

    enc = tok("And God said", return_tensors="pt")
    for _ in range(3):
        t = time.perf_counter()
        model.generate(**enc, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                       repetition_penalty=1.0)
        print(f"64 greedy tokens: {time.perf_counter() - t:.3f}s")


if __name__ == "__main__":
    main()
