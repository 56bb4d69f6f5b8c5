"""Prometheus metrics of the tokenizer and detokenizer services (defined once per process).

Token counters carry the `model_name` label (the tokenizer's model); the rest is per process."""

from __future__ import annotations

from minisgl_core.metrics import MODEL, STEP_BUCKETS, counter, gauge, histogram

TOKENIZE_ITEMS = counter("tokenizer_items_total", "Tokenize items by input kind", ("kind",))
TOKENIZE_ERRORS = counter("tokenizer_item_errors_total", "Tokenize items rejected, by error code",
                          ("code",))
PROMPT_TOKENS = counter("tokenizer_prompt_tokens_total", "Prompt tokens returned by Tokenize",
                        (MODEL,))
TOKENIZE_SECONDS = histogram("tokenizer_request_seconds", "Tokenize call latency", STEP_BUCKETS)

DETOK_STREAMS = gauge("detokenizer_streams", "Open Detokenize streams")
DETOK_REQUESTS = gauge("detokenizer_requests", "Requests with detokenization state")
DETOK_TOKENS = counter("detokenizer_tokens_total", "Tokens detokenized", (MODEL,))
DETOK_STOPS = counter("detokenizer_stop_strings_total", "Requests stopped by a stop string")
DETOK_STEP_SECONDS = histogram("detokenizer_step_seconds", "Time to detokenize one step message",
                               STEP_BUCKETS)
