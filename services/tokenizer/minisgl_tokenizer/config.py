"""The tokenizer's and the detokenizer's flags: one declaration, two services (each reads its own
MINISGL_TOKENIZER_* / MINISGL_DETOKENIZER_* variables and listens on its own default ports)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl_core.config import DEFAULT_METRICS_PORTS, DEFAULT_PORTS
from minisgl_core.flags import ServerFlags, ServiceFlags, flag

DESCRIPTIONS = {
    "tokenizer": "minisgl tokenizer service: text, token ids or chat messages (rendered with the "
                 "model's chat template) to token ids, batched.",
    "detokenizer": "minisgl detokenizer service: incremental detokenization with stop strings for "
                   "many requests over one bidirectional stream.",
}


@dataclass
class TokenizerFlags:
    # None: required (the services refuse to start without it); MINISGL_MODEL_PATH is shared so
    # that one variable names the model for both services.
    model: str | None = flag(None, "model directory with tokenizer.json (env MINISGL_MODEL_PATH)",
                             env_fallback="MINISGL_MODEL_PATH")
    max_model_len: int = flag(0, "context window in tokens (0: from config.json)")
    max_workers: int = flag(64, "gRPC threads (each open Detokenize stream holds one)")


def service_flags(service: str) -> ServiceFlags:
    return ServiceFlags(service, DESCRIPTIONS[service], (ServerFlags, TokenizerFlags),
                        defaults={"port": DEFAULT_PORTS[service],
                                  "metrics_port": DEFAULT_METRICS_PORTS[service]})


TOKENIZER_FLAGS = service_flags("tokenizer")
DETOKENIZER_FLAGS = service_flags("detokenizer")
