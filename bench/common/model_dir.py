"""Make a servable model directory from a shipped config.json: the config plus a synthetic tokenizer.

Real tokenizers cannot be downloaded here, so benchmarks of the full stack use a word-level tokenizer
with exactly `vocab_size` entries (`w0`, `w1`, ...): every token id decodes, so tokenizer and
detokenizer do real work of the same shape. Weights come from `--load-format dummy`.

    python -m bench.common.model_dir models/configs/Qwen3-0.6B /tmp/qwen3-0.6b-bench
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def make(config_dir: str, out_dir: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    src, out = Path(config_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if src.resolve() != out.resolve():
        shutil.copy(src / "config.json", out / "config.json")
    cfg = json.loads((src / "config.json").read_text())
    vocab_size = cfg["vocab_size"]
    eos = cfg.get("eos_token_id", vocab_size - 1)
    eos = eos[0] if isinstance(eos, list) else eos
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": f"w{eos}", "model_max_length": cfg.get("max_position_embeddings", 4096),
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out


if __name__ == "__main__":
    print(make(sys.argv[1], sys.argv[2]))
