"""The embedded model is a standard Hugging Face Qwen3 checkpoint with a ChatML tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

MAX_DIR_BYTES = 12_500_000  # the issue allows "at most ~12 MB" in the repo


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_standard_files_and_size(tiny_model_path: Path) -> None:
    names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json"}  # fmt: skip
    assert names <= {p.name for p in tiny_model_path.iterdir()}
    total = sum(p.stat().st_size for p in tiny_model_path.iterdir() if p.is_file())
    assert total <= MAX_DIR_BYTES, total


def test_config_is_qwen3_and_eos_is_im_end(tiny_model_path: Path) -> None:
    from tokenizers import Tokenizer

    cfg = _json(tiny_model_path / "config.json")
    gen = _json(tiny_model_path / "generation_config.json")
    tok = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["vocab_size"] == tok.get_vocab_size()
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert cfg["eos_token_id"] == im_end
    assert set(gen["eos_token_id"]) == {im_end, eot}


def test_safetensors_are_bf16_with_hf_names(tiny_model_path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_model_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    cfg = _json(tiny_model_path / "config.json")
    assert "model.embed_tokens.weight" in keys and "model.norm.weight" in keys
    assert "model.layers.0.self_attn.q_norm.weight" in keys  # Qwen3's per-head q/k RMSNorm
    assert f"model.layers.{cfg['num_hidden_layers'] - 1}.mlp.down_proj.weight" in keys
    assert "lm_head.weight" not in keys and cfg["tie_word_embeddings"] is True
    assert dtypes == {"BF16"}


def test_chat_template_renders_chatml(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.eos_token == "<|im_end|>"
    # Special tokens are single ids, and the transformers tokenizer agrees with tokenizer.json.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    ids = raw.encode(text, add_special_tokens=False).ids
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == raw.token_to_id("<|im_start|>")
    assert raw.decode(raw.encode("“Lord,” she said — 3 times.").ids) == "“Lord,” she said — 3 times."
