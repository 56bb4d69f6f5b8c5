"""Entry points: `python -m minisgl_tokenizer {tokenizer,detokenizer} --model PATH [...]`, or the
console scripts `minisgl-tokenizer` and `minisgl-detokenizer`.

Flags fall back to environment variables: MINISGL_<SERVICE>_<FLAG> (e.g. MINISGL_TOKENIZER_PORT,
MINISGL_DETOKENIZER_PORT), MINISGL_MODEL_PATH for --model, MINISGL_LOG_LEVEL for --log-level.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from minisgl_core.security import check_listener, from_args
from minisgl_core.serving import ServiceHost, message_limit
from minisgl_core.startup import begin

from minisgl_tokenizer.config import DESCRIPTIONS, service_flags

log = logging.getLogger(__name__)


def _parse(service: str, argv: list[str] | None) -> argparse.Namespace:
    flags = service_flags(service)
    ns = flags.parse(argv)
    if not ns.model:
        flags.parser().error("--model (or MINISGL_MODEL_PATH) is required")
    return ns


def run(service: str, argv: list[str] | None = None) -> int:
    ns = _parse(service, argv)
    begin(service, ns.log_level)
    security = from_args(ns.internal_token_file, ns.internal_tls_dir)
    check_listener(service, ns.host, security, ns.insecure)
    # The server's threads already run requests in parallel; Rust's own pool would oversubscribe.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from minisgl_core.proto.minisgl.v1 import detokenizer_pb2_grpc, tokenizer_pb2_grpc

    from minisgl_tokenizer.model_files import ModelTokenizer
    from minisgl_tokenizer.server import DetokenizerServicer, TokenizerServicer

    try:
        model = ModelTokenizer.load(ns.model, ns.max_model_len)
    except (OSError, ValueError) as exc:
        log.error("cannot load the tokenizer from %s: %s", ns.model, exc)
        return 2
    host = ServiceHost(service, ns.host, ns.port, metrics_port=ns.metrics_port or None,
                       max_workers=ns.max_workers, security=security,
                       metrics_host=ns.metrics_host or None,
                       max_message_bytes=message_limit(model.max_model_len),
                       reflection=ns.reflection)
    if service == "tokenizer":
        host.add(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, TokenizerServicer(model),
                 "minisgl.v1.Tokenizer")
    else:
        servicer = DetokenizerServicer(model)
        host.add(detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, servicer,
                 "minisgl.v1.Detokenizer")
        host.on_drain(servicer.drain)
    host.serve_forever(drain_timeout=ns.drain_timeout)
    return 0


def tokenizer_main() -> None:
    sys.exit(run("tokenizer"))


def detokenizer_main() -> None:
    sys.exit(run("detokenizer"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in DESCRIPTIONS:
        print("usage: python -m minisgl_tokenizer {tokenizer,detokenizer} --model PATH [options]\n"
              "       python -m minisgl_tokenizer tokenizer --help", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
