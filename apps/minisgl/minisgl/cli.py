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

from minisgl.flags import SERVICES, RoutedFlag, add_service_flags, route
from minisgl.launcher import Stack, StackConfig

DEFAULT_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny"


SERVE_EPILOG = """\
Every other flag of a service can be given directly: it goes to each service that declares it
(--max-prefill-tokens: the scheduler and the worker). The launcher's own flags above keep their
meaning where a service has a flag of the same name (--model, --host, --port, --grpc-port,
--log-level, --log-format, --internal-tls-dir). --<service>-args strings come last, so they win
over a flag given directly."""


def _serve_parser(sub: argparse._SubParsersAction, engine_flags: bool) -> list[RoutedFlag]:
    """`minisgl serve`'s parser; with `engine_flags`, also every service flag it routes (the
    worker's declarations import torch, which `minisgl shell` need not pay for)."""
    p = sub.add_parser("serve", help="start all five services on loopback and wait",
                       formatter_class=_ServeHelpFormatter, epilog=SERVE_EPILOG,
                       usage="%(prog)s [--model DIR] [options] [service flags]")
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
                        "all of them (--routing, default cache_aware)")
    p.add_argument("--internal-token", action=argparse.BooleanOptionalAction, default=True,
                   help="a random per-run token on every internal RPC, so other local users "
                        "cannot drive the internal services")
    p.add_argument("--internal-tls-dir", default="", metavar="DIR",
                   help="mTLS between the services: the OUTDIR of scripts/gen_internal_certs.py")
    for name in SERVICES:
        p.add_argument(f"--{name}-args", default="", metavar="FLAGS",
                       help=f"extra flags for the {name} (one quoted string; they win over "
                            "the same flag given directly)")
    return add_service_flags(p) if engine_flags else []


class _ServeHelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                          argparse.RawDescriptionHelpFormatter):
    """Defaults shown for the launcher's flags; the epilog keeps its lines."""


def stack_config(args: argparse.Namespace, routed: list[RoutedFlag]) -> StackConfig:
    direct = route(args, routed)
    # An explicit per-service string comes last: argparse keeps a flag's last value.
    extra = {n: direct[n] + shlex.split(getattr(args, f"{n}_args")) for n in SERVICES}
    return StackConfig(model_path=args.model, host=args.host, http_port=args.port,
                       grpc_port=args.grpc_port, extra_args=extra,
                       log_level=args.log_level, log_format=args.log_format,
                       gateway_replicas=max(1, args.gateway_replicas),
                       engine_replicas=max(1, args.engines),
                       internal_token=args.internal_token,
                       internal_tls_dir=args.internal_tls_dir)


def serve(args: argparse.Namespace, routed: list[RoutedFlag]) -> int:
    begin("launcher", args.log_level, args.log_format)
    stack = Stack(stack_config(args, routed))
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


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[RoutedFlag], list[str]]:
    """The command, the service flags `serve` routes, and what is left for `shell`."""
    parser = argparse.ArgumentParser(prog="minisgl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"minisgl {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    routed = _serve_parser(sub, engine_flags=argv[:1] == ["serve"])
    sub.add_parser("shell", help="chat with a gateway (or a local stack) in the terminal",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve" and rest:
        unknown = [a.split("=", 1)[0] for a in rest if a.startswith("-")] or rest
        parser.error(f"unrecognized arguments: {' '.join(rest)} (no service of minisgl serve "
                     f"declares {', '.join(unknown)}; `minisgl serve --help` lists the flags)")
    return args, routed, rest


def main(argv: list[str] | None = None) -> int:
    args, routed, rest = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "shell":
        from minisgl.shell import main as shell_main

        return shell_main(rest)
    return serve(args, routed)


if __name__ == "__main__":
    sys.exit(main())
