"""Model directories built in the test: a byte-level BPE tokenizer trained here on multilingual
text, saved twice, once as a ChatML (Qwen-style) model and once as a Llama-3-style model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .templates import CHATML_TOOLS, LLAMA3

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "models" / "tiny"

CORPUS = [
    "In the beginning the quick brown fox jumps over the lazy dog, again and again.",
    "Café déjà vu: naïve façade, crème brûlée, Über straße, señor piñata, smörgåsbord.",
    "中文分词测试：我们今天去公园散步，天气很好。日本語のテキストも少し。한국어 문장도 있습니다.",
    "Emoji time 🎉🚀👍🏽 and a family 👨‍👩‍👧 with flags 🇫🇷🇯🇵 — done ✅.",
    "Русский текст и ελληνικά γράμματα, plus العربية and עברית for good measure.",
    "Numbers 3.14159 and code: def f(x): return x ** 2  # comment\n\tindented\n",
    "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>",
]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


def train_bpe(specials: list[str], vocab_size: int = 700) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


def _added_tokens(specials: list[str], tok: Tokenizer) -> dict[str, dict]:
    return {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": True}
            for t in specials}


def _write(path: Path, name: str, data: dict) -> None:
    (path / name).write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")


def write_chatml_model(path: Path, context: int = 4096) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(CHATML_SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    _write(path, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": _added_tokens(CHATML_SPECIALS, tok),
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False, "model_max_length": context,
        "chat_template": CHATML_TOOLS,
    })
    _write(path, "generation_config.json", {"eos_token_id": [tok.token_to_id("<|im_end|>"),
                                                             tok.token_to_id("<|endoftext|>")]})
    _write(path, "config.json", {"max_position_embeddings": context, "vocab_size": 1024})
    return path


def write_llama_model(path: Path, context: int = 4096) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(LLAMA_SPECIALS)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(path / "tokenizer.json"))
    _write(path, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": _added_tokens(LLAMA_SPECIALS, tok),
        "bos_token": bos, "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": False, "model_max_length": context,
    })
    # A template saved as a file wins over tokenizer_config.json (transformers' rule too).
    (path / "chat_template.jinja").write_text(LLAMA3, encoding="utf-8")
    _write(path, "generation_config.json", {"eos_token_id": [tok.token_to_id("<|end_of_text|>"),
                                                             tok.token_to_id("<|eom_id|>"),
                                                             tok.token_to_id("<|eot_id|>")]})
    _write(path, "config.json", {"max_position_embeddings": context})
    return path


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chatml_model(tmp_path_factory.mktemp("chatml"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_model(tmp_path_factory.mktemp("llama3"))
