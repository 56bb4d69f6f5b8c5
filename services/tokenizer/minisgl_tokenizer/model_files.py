"""Everything the tokenizer services read from a Hugging Face model directory, loaded once.

- tokenizer.json: the fast tokenizer (required).
- tokenizer_config.json: chat template, named special tokens (bos/eos/...),
  add_bos_token/add_eos_token.
- chat_template.jinja and additional_chat_templates/*.jinja: templates saved as files; as in
  transformers they take priority over the `chat_template` entry of tokenizer_config.json.
- generation_config.json: eos_token_id (int or list), the ids that end generation.
- config.json: max_position_embeddings (the context window) and vocab_size (the embedding rows).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, processors

from minisgl_tokenizer.chat_template import ChatTemplates

log = logging.getLogger(__name__)

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions",
                 "max_seq_len")
# The context of configs that leave it to transformers' defaults (the public Gemma 3 multimodal
# configs write a sparse text_config), by model_type: the worker applies the same defaults.
_DEFAULT_CONTEXT = {"gemma3": 131072, "gemma3_text": 131072}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _config_value(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for scope in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


@dataclass
class ModelTokenizer:
    """The loaded tokenizer files; shared read-only by the tokenizer and detokenizer classes."""

    name: str
    tokenizer: Tokenizer
    chat: ChatTemplates
    eos_token_ids: list[int]
    max_model_len: int
    vocab_size: int  # ids in [0, vocab_size) are accepted as input
    special_text: dict[int, str] = field(default_factory=dict)  # special added tokens: id -> text

    @classmethod
    def load(cls, path: str | Path, max_model_len: int = 0) -> ModelTokenizer:
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(
                f"{tok_file} not found: the tokenizer services need a fast tokenizer "
                "(tokenizer.json)")
        tokenizer = Tokenizer.from_file(str(tok_file))
        tok_config = _read_json(root / "tokenizer_config.json")
        gen_config = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")

        named = _named_special_tokens(tok_config)
        _apply_bos_eos(tokenizer, tok_config, named)
        chat = ChatTemplates(_chat_templates(root, tok_config), named)
        eos = _eos_ids(tokenizer, gen_config, model_config, named)

        vocab = tokenizer.get_vocab(with_added_tokens=True)
        tok_vocab = max(vocab.values(), default=-1) + 1
        model_vocab = _config_value(model_config, ("vocab_size",))
        vocab_size = min(tok_vocab, model_vocab) if model_vocab else tok_vocab

        context = max_model_len or _config_value(model_config, _CONTEXT_KEYS)
        if not context:
            text = model_config.get("text_config") or {}
            kind = text.get("model_type") or model_config.get("model_type")
            context = _DEFAULT_CONTEXT.get(kind, 0) if isinstance(kind, str) else 0
        if not context:
            limit = tok_config.get("model_max_length")
            context = int(limit) if isinstance(limit, (int, float)) and 0 < limit < 10**7 else 0
        if not context:
            raise ValueError(f"{root}: cannot tell the context window (no "
                             "max_position_embeddings in config.json); pass --max-model-len")

        special_text = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()
                        if t.special}
        log.info("loaded tokenizer %s: vocab %d, context %d, eos %s, chat template %s", root.name,
                 vocab_size, context, eos, "yes" if chat else "no")
        return cls(root.resolve().name, tokenizer, chat, eos, context, vocab_size, special_text)


def _named_special_tokens(tok_config: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... plus any model-specific `*_token` entry, as transformers (v5)
    exposes them to chat templates."""
    named: dict[str, str] = {}
    for key, value in tok_config.items():
        if key in NAMED_SPECIAL_TOKENS or (key.endswith("_token") and key != "added_tokens"):
            text = _token_text(value)
            if text is not None:
                named[key] = text
    return named


def _apply_bos_eos(tokenizer: Tokenizer, tok_config: dict[str, Any], named: dict[str, str]) -> None:
    """`add_bos_token`/`add_eos_token` in tokenizer_config.json, for tokenizer.json files without a
    post-processor (one that has one already says what to add, and transformers keeps it)."""
    if tokenizer.post_processor is not None:
        return
    add_bos = bool(tok_config.get("add_bos_token")) and "bos_token" in named
    add_eos = bool(tok_config.get("add_eos_token")) and "eos_token" in named
    if not (add_bos or add_eos):
        return
    bos, eos = named.get("bos_token", ""), named.get("eos_token", "")
    single = " ".join([*(f"{bos}:0",) * add_bos, "$A:0", *(f"{eos}:0",) * add_eos])
    pair = " ".join([single, *(f"{bos}:1",) * add_bos, "$B:1", *(f"{eos}:1",) * add_eos])
    specials = [(t, tokenizer.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    if any(i is None for _, i in specials):
        log.warning("add_bos_token/add_eos_token set but the token is not in the vocabulary")
        return
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials)


def _chat_templates(root: Path, tok_config: dict[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    default = root / "chat_template.jinja"
    if default.exists():
        templates["default"] = default.read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    entry = tok_config.get("chat_template")
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in entry
                if isinstance(t, dict) and "name" in t and "template" in t}
    return {}


def _eos_ids(tokenizer: Tokenizer, gen_config: dict[str, Any], model_config: dict[str, Any],
             named: dict[str, str]) -> list[int]:
    ids: list[int] = []
    for source in (gen_config.get("eos_token_id"), model_config.get("eos_token_id")):
        for value in source if isinstance(source, list) else [source]:
            if isinstance(value, int) and value not in ids:
                ids.append(value)
    if "eos_token" in named:
        tid = tokenizer.token_to_id(named["eos_token"])
        if tid is not None and tid not in ids:
            ids.append(tid)
    return ids
