"""`minisgl shell`: chat in the terminal over the gateway's gRPC ChatStream.

With --target HOST:PORT it talks to a running gateway; without, it starts the local five-service
stack (the embedded tiny model unless --model says otherwise) and stops it on exit. Tokens are
printed as they arrive; the conversation is kept until /reset. Ctrl-C stops a running answer."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

import grpc
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

PROMPT = ">>> "
HELP = "commands: /reset (forget the conversation), /exit (quit), /help"
DEFAULT_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minisgl shell", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="", help="gateway gRPC address; empty: start a local stack")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model for the local stack")
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--api-key", default="", help="sent as 'authorization: Bearer KEY'")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per answer")
    p.add_argument("--connect-timeout", type=float, default=30.0,
                   help="seconds to wait for the gateway to be reachable")
    return p


class Shell:
    def __init__(self, stub: generation_pb2_grpc.GenerationStub, args: argparse.Namespace,
                 out: TextIO = sys.stdout) -> None:
        self.stub = stub
        self.args = args
        self.out = out
        self.history: list[common_pb2.ChatMessage] = []
        self.metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()

    def _sampling(self) -> common_pb2.SamplingParams:
        a = self.args
        sp = common_pb2.SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                       max_tokens=a.max_tokens)
        if a.seed is not None:
            sp.seed = a.seed
        return sp

    def ask(self, text: str) -> str | None:
        """Stream one answer; returns it (None on error or interrupt: history unchanged)."""
        user = common_pb2.ChatMessage(role="user", content=text)
        messages = list(self.history) + [user]
        if self.args.system:
            messages.insert(0, common_pb2.ChatMessage(role="system", content=self.args.system))
        call = self.stub.ChatStream(
            generation_pb2.ChatRequest(messages=messages, sampling=self._sampling()),
            metadata=self.metadata, timeout=self.args.timeout)
        pieces: list[str] = []
        try:
            for reply in call:
                for choice in reply.choices:
                    pieces.append(choice.text)
                    self.out.write(choice.text)
                    self.out.flush()
        except KeyboardInterrupt:
            call.cancel()
            self.out.write("\n[stopped]\n")
            return None
        except grpc.RpcError as exc:
            self.out.write(f"\n[error] {exc.code().name}: {exc.details()}\n")
            return None
        self.out.write("\n")
        answer = "".join(pieces)
        self.history += [user, common_pb2.ChatMessage(role="assistant", content=answer)]
        return answer

    def handle(self, line: str) -> bool:
        """One input line; False when the shell should exit."""
        line = line.strip()
        if not line:
            return True
        if line in ("/exit", "/quit"):
            return False
        if line == "/reset":
            self.history.clear()
            self.out.write("[conversation reset]\n")
        elif line == "/help":
            self.out.write(HELP + "\n")
        elif line.startswith("/"):
            self.out.write(f"unknown command {line.split()[0]}; {HELP}\n")
        else:
            self.ask(line)
        return True

    def loop(self, stdin: TextIO = sys.stdin) -> None:
        self.out.write(f"minisgl shell. {HELP}\n")
        while True:
            self.out.write(PROMPT)
            self.out.flush()
            try:
                line = stdin.readline()
            except KeyboardInterrupt:
                self.out.write("\n")
                return
            if not line or not self.handle(line):  # EOF (Ctrl-D) or /exit
                return


def _start_local(model: str) -> Any:
    try:
        from minisgl_core.ports import free_port

        from minisgl.launcher import start_stack
    except ImportError as exc:  # pragma: no cover - the launcher ships with this package
        raise SystemExit(f"cannot start a local stack ({exc}); pass --target HOST:PORT") from None
    log_dir = Path(tempfile.mkdtemp(prefix="minisgl-shell-"))
    print(f"starting the local stack for {model} (logs in {log_dir}) ...", flush=True)
    return start_stack(model, http_port=free_port(), grpc_port=free_port(),
                       internal_ports={n: 0 for n in ("worker", "tokenizer", "detokenizer",
                                                      "scheduler")},
                       log_dir=log_dir, log_level="warning")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    stack = None
    target = args.target
    if not target:
        stack = _start_local(args.model)
        target = stack.grpc_target
    try:
        with grpc.insecure_channel(target) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=args.connect_timeout)
            except grpc.FutureTimeoutError:
                print(f"cannot reach a gateway at {target}", file=sys.stderr)
                return 1
            Shell(generation_pb2_grpc.GenerationStub(channel), args).loop()
    finally:
        if stack is not None:
            stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
