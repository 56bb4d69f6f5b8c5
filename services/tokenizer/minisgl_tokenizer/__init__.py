"""minisgl tokenizer services: one code base, two deployables (tokenizer and detokenizer).

Torch-free and transformers-free: Hugging Face `tokenizers` (Rust) and the model's Jinja chat
template. The plain classes below are the one copy of the logic; `server.py` wraps them in gRPC and
the in-process `minisgl.LLM` uses them directly:

    model = ModelTokenizer.load("models/tiny")
    ids = PromptTokenizer(model).tokenize([ChatPrompt([{"role": "user", "content": "hi"}])])
    detok = Detokenizer(model.tokenizer, model.special_text)
    deltas = detok.step([DetokenizeUpdate(rid=1, token_ids=[...], stop=StopConditions(("\\n",)))])
"""

from minisgl_tokenizer.chat_template import ChatTemplateError, ChatTemplates
from minisgl_tokenizer.detokenizer import (
    Detokenizer,
    DetokenizeUpdate,
    StopConditions,
    TextDelta,
)
from minisgl_tokenizer.incremental import IncrementalDecoder
from minisgl_tokenizer.model_files import ModelTokenizer
from minisgl_tokenizer.prompt import (
    ChatPrompt,
    ErrorCode,
    ItemError,
    PromptTokenizer,
    TextPrompt,
    TokenIdsPrompt,
    TokenizeResult,
)
from minisgl_tokenizer.stop_strings import StopMatcher

__all__ = [
    "ChatPrompt",
    "ChatTemplateError",
    "ChatTemplates",
    "DetokenizeUpdate",
    "Detokenizer",
    "ErrorCode",
    "IncrementalDecoder",
    "ItemError",
    "ModelTokenizer",
    "PromptTokenizer",
    "StopConditions",
    "StopMatcher",
    "TextDelta",
    "TextPrompt",
    "TokenIdsPrompt",
    "TokenizeResult",
]
