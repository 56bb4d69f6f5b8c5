"""`minisgl serve` (the five services on loopback) and `minisgl shell` (an interactive chat)."""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import threading
from pathlib import Path

from minisgl_core.config import DEFAULT_PORTS, version
from minisgl_core.logging import LOG_FORMATS
from minisgl_core.startup import begin, report_failure

from minisgl.launcher import Stack, StackConfig

DEFAULT_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny"


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start all five services on loopback and wait",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="address of the public listeners")
    p.add_argument("--port", type=int, default=DEFAULT_PORTS["gateway_http"],
                   help="OpenAI-compatible HTTP port")
    p.add_argument("--grpc-port", type=int, default=DEFAULT_PORTS["gateway_grpc"],
                   help="public gRPC port")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="auto", choices=LOG_FORMATS,
                   help="text or json lines, for the launcher and every service; auto: text on "
                        "a terminal, json otherwise")
    p.add_argument("--gateway-replicas", type=int, default=1,
                   help="gateway processes sharing the public ports (one carries ~10k "
                        "streamed tokens/s)")
    p.add_argument("--engines", "--engine-replicas", dest="engines", type=int, default=1,
                   help="engines (a scheduler and its worker each); every gateway routes over "
                        "all of them (gateway --routing, default cache_aware)")
    p.add_argument("--internal-token", action=argparse.BooleanOptionalAction, default=True,
                   help="a random per-run token on every internal RPC, so other local users "
                        "cannot drive the internal services")
    p.add_argument("--internal-tls-dir", default="", metavar="DIR",
                   help="mTLS between the services: the OUTDIR of scripts/gen_internal_certs.py")
    for name in ("worker", "scheduler", "tokenizer", "detokenizer", "gateway"):
        p.add_argument(f"--{name}-args", default="", metavar="FLAGS",
                       help=f"extra flags for the {name} (one quoted string)")


def serve(args: argparse.Namespace) -> int:
    begin("launcher", args.log_level, args.log_format)
    extra = {n: shlex.split(getattr(args, f"{n}_args")) for n in
             ("worker", "scheduler", "tokenizer", "detokenizer", "gateway")}
    stack = Stack(StackConfig(model_path=args.model, host=args.host, http_port=args.port,
                              grpc_port=args.grpc_port, extra_args=extra,
                              log_level=args.log_level, log_format=args.log_format,
                              gateway_replicas=max(1, args.gateway_replicas),
                              engine_replicas=max(1, args.engines),
                              internal_token=args.internal_token,
                              internal_tls_dir=args.internal_tls_dir))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        stack.start()
    except Exception as exc:  # start() already stopped what it had started
        report_failure(exc)
        return 1
    print(
        f"\nminisgl is serving {args.model}\n"
        f"  OpenAI HTTP : {stack.http_url}/v1  (try: curl {stack.http_url}/v1/models)\n"
        f"  gRPC        : {stack.grpc_target}  (minisgl.v1.Generation; reflection on)\n"
        f"  Ctrl-C stops all services.\n",
        flush=True,
    )
    code = 0
    while not stop.wait(0.5):
        dead = [n for n, p in stack.processes.items() if p.poll() is not None]
        if dead:
            logging.getLogger("minisgl").error("service exited unexpectedly: %s", dead)
            code = 1
            break
    stack.stop()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minisgl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"minisgl {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    sub.add_parser("shell", help="chat with a gateway (or a local stack) in the terminal",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "shell":
        from minisgl.shell import main as shell_main

        return shell_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
