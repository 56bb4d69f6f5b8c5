"""Prompts to token ids, many per call: text, token ids (range-checked), or chat messages.

Each item gets either token ids or an error of its own; one bad item never fails the others. Text of
all items is encoded in one `encode_batch` call per add_special_tokens setting (Rust, parallel).
Text that cannot fit is refused before it is encoded whole (`bounds`), so the work per item is
bounded by the context window, not by the size of the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl_core.codes import ErrorCode

from minisgl_tokenizer.bounds import TextBounds
from minisgl_tokenizer.chat_template import ChatTemplateError
from minisgl_tokenizer.model_files import ModelTokenizer
from minisgl_tokenizer.special_text import Masked, SpecialTextEscaper


@dataclass(slots=True)
class ItemError:
    code: ErrorCode
    message: str


class InvalidPrompt(ValueError):
    """Raised while converting an item; becomes that item's INVALID_ARGUMENT error."""


@dataclass(slots=True)
class TextPrompt:
    text: str
    add_special_tokens: bool = True


@dataclass(slots=True)
class TokenIdsPrompt:
    token_ids: list[int]


@dataclass(slots=True)
class ChatPrompt:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes the special tokens itself
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking


Prompt = TextPrompt | TokenIdsPrompt | ChatPrompt


@dataclass(slots=True)
class TokenizeResult:
    token_ids: list[int] = field(default_factory=list)
    error: ItemError | None = None


class PromptTokenizer:
    def __init__(self, model: ModelTokenizer) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.bounds = TextBounds.of(model.tokenizer, model.max_model_len)
        self.escaper = SpecialTextEscaper(model.tokenizer, list(model.special_text.values()))

    def tokenize(self, items: list[Prompt | ItemError], max_prompt_tokens: int = 0) -> list[
            TokenizeResult]:
        """Results aligned with `items`; an ItemError in the input (from conversion) passes through.
        `max_prompt_tokens`: the most prompt tokens allowed (0: the context window minus one, so
        that at least one token can be generated)."""
        results = [TokenizeResult() for _ in items]
        if max_prompt_tokens < 0:
            err = ItemError(ErrorCode.INVALID_ARGUMENT, "max_prompt_tokens must be >= 0")
            return [TokenizeResult(error=err) for _ in items]
        limit = min(max_prompt_tokens or self.model.max_model_len - 1,
                    self.model.max_model_len - 1)
        texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
        escaped: list[tuple[int, str, Masked, bool]] = []  # chats whose client text had specials
        for i, item in enumerate(items):
            if isinstance(item, ItemError):
                results[i].error = item
            elif isinstance(item, TextPrompt):
                texts[item.add_special_tokens].append((i, item.text))
            elif isinstance(item, TokenIdsPrompt):
                results[i].token_ids = list(item.token_ids)
            else:
                masked = self.escaper.mask(item.messages, item.tools)
                try:
                    rendered = self.model.chat.render(
                        masked.messages if masked else item.messages,
                        masked.tools if masked else item.tools,
                        item.add_generation_prompt, item.template_kwargs)
                except ChatTemplateError as exc:
                    results[i].error = ItemError(ErrorCode.INVALID_ARGUMENT, str(exc))
                    continue
                if masked is None:
                    texts[item.add_special_tokens].append((i, rendered))
                else:
                    escaped.append((i, rendered, masked, item.add_special_tokens))
        for i, rendered, masked, add_special in escaped:
            why = self.bounds.too_long(rendered, limit)
            if why is not None:
                results[i].error = ItemError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, why)
            else:
                results[i].token_ids = self.escaper.encode(rendered, masked, add_special)
        for add_special, batch in texts.items():
            for i, text in batch:
                why = self.bounds.too_long(text, limit)
                if why is not None:
                    results[i].error = ItemError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, why)
            batch = [(i, t) for i, t in batch if results[i].error is None]
            if batch:
                encodings = self.tokenizer.encode_batch([t for _, t in batch],
                                                        add_special_tokens=add_special)
                for (i, _), enc in zip(batch, encodings, strict=True):
                    results[i].token_ids = enc.ids
        for result in results:
            if result.error is None:
                result.error = self._check(result.token_ids, limit)
                if result.error is not None:
                    result.token_ids = []
        return results

    def _check(self, ids: list[int], limit: int) -> ItemError | None:
        if not ids:
            return ItemError(ErrorCode.INVALID_ARGUMENT, "the prompt is empty (0 tokens)")
        context = self.model.max_model_len
        if len(ids) > min(limit, context - 1):
            if limit < context - 1:
                why = f"the limit for this request is {limit} tokens"
            else:
                why = f"the model's context window is {context} tokens, leaving room for at most " \
                      f"{context - 1} prompt tokens"
            return ItemError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                             f"the prompt has {len(ids)} tokens; {why}")
        vocab = self.model.vocab_size  # after the length: min/max scan bounded ids only
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            return ItemError(ErrorCode.INVALID_ARGUMENT,
                             f"token id {bad} is out of range: the vocabulary has ids "
                             f"0..{vocab - 1}")
        return None

    def decode_each(self, ids: list[int]) -> list[str]:
        """Each id on its own (logprob alternatives), special tokens kept; unknown ids give ""."""
        safe = [[i] if 0 <= i < 2**32 else [] for i in ids]
        return self.tokenizer.decode_batch(safe, skip_special_tokens=False)

    def decode_joined(self, ids: list[int]) -> str:
        """The ids as one text (/detokenize), special tokens kept; unknown ids are dropped."""
        return self.tokenizer.decode([i for i in ids if 0 <= i < 2**32],
                                     skip_special_tokens=False)
