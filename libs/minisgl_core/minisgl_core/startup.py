"""Process start for every service: logging, tracing, and start-up failures as one clear line.

    begin("scheduler", ns.log_level)   # replaces setup_logging(...) in a service's main

An exception that escapes a service's main becomes one log line (in the chosen log format) that
says what went wrong and what to do, e.g. "port 50063 is in use: stop the process listening there
or pick another --port"; the traceback follows only with --log-level debug. The process exits 1.
"""

from __future__ import annotations

import errno
import logging
import sys
from types import TracebackType

from minisgl_core import tracing
from minisgl_core.logging import setup_logging

log = logging.getLogger("minisgl.startup")


def _port_of(text: str) -> str:
    for word in text.replace("'", " ").replace('"', " ").split():
        host, sep, port = word.strip(".,;:()[]").rpartition(":")
        if sep and port.isdigit():
            return port
    return ""


class StartupError(RuntimeError):
    """A start-up failure whose message already says what to do: `explain` keeps it as is."""


def explain(exc: BaseException) -> str:
    """One line: what failed and what to do about it."""
    if isinstance(exc, StartupError):
        return str(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lower = text.lower()
    name = type(exc).__name__
    if (isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE) or "address already in use" \
            in lower or "cannot listen on" in lower or "failed to bind" in lower:
        port = _port_of(text)
        where = f"port {port}" if port else "the port"
        return (f"{where} is in use ({text}): stop the process listening there or pick another "
                f"--port")
    if isinstance(exc, FileNotFoundError) or "no such file" in lower or \
            "does not exist" in lower:
        return (f"a file or directory is missing ({text}): check --model points at a model "
                f"directory with config.json (and the other paths given)")
    if "cuda" in lower and any(w in lower for w in ("not available", "no cuda", "driver",
                                                    "unavailable", "not compiled")):
        return (f"CUDA is not usable ({text}): check the GPU with nvidia-smi, or run on CPU with "
                f"--device cpu")
    if name == "WorkerFailed" or "worker" in lower and any(
            w in lower for w in ("unreachable", "cannot reach", "not reachable", "did not answer",
                                 "unavailable", "not healthy", "waiting")):
        return (f"the worker is unreachable ({text}): start the worker first, or fix --worker "
                f"(and --worker-timeout)")
    if "upstreams not ready" in lower:
        return (f"the gateway's upstreams did not come up ({text}): start the tokenizer, "
                f"detokenizer and scheduler first, or fix --tokenizer / --detokenizer / "
                f"--scheduler (and --startup-timeout)")
    if isinstance(exc, PermissionError):
        return f"permission denied ({text}): check the path's owner and mode"
    if isinstance(exc, MemoryError) or "out of memory" in lower:
        return (f"out of memory ({text}): lower --mem-fraction, --max-slots or --num-pages, or "
                f"use a smaller model")
    return f"{name}: {text} (rerun with --log-level debug for the traceback)"


def report_failure(exc: BaseException, service: str = "") -> None:
    """Log `exc` as one clear error line; with debug logging the traceback comes too."""
    prefix = f"{service} failed to start: " if service else "start-up failed: "
    debug = logging.getLogger().isEnabledFor(logging.DEBUG)
    log.error("%s%s", prefix, explain(exc), exc_info=exc if debug else None)


def begin(service: str, log_level: str = "info", log_format: str | None = None) -> None:
    """Logging (format from --log-format), tracing (from OTEL_*), and the failure hook."""
    setup_logging(service, log_level, log_format)
    tracing.setup(service)

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, exc, tb)
            return
        report_failure(exc, service)

    sys.excepthook = hook
