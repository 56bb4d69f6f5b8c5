"""Every service's flag declarations in one place, for `minisgl serve` (which hands each flag it is
given to the services declaring it) and for the flag table in docs/operations.md.

`minisgl serve --max-prefill-tokens 4096 --kv-cache-dtype fp8_e4m3` gives --max-prefill-tokens to
the scheduler and the worker (both declare it) and --kv-cache-dtype to the worker; the text goes
through unchanged, after the launcher's own flags and before `--<service>-args`, so an explicit
per-service string wins (argparse keeps a flag's last value).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from minisgl_core.flags import Flag, ServiceFlags

# Start order of `minisgl serve`, which is also the order of the docs table and of --help.
SERVICES = ("worker", "tokenizer", "detokenizer", "scheduler", "gateway")


def service_flags() -> dict[str, ServiceFlags]:
    # Imported when asked for: the worker's declarations import torch, which `minisgl shell`
    # and `import minisgl` should not pay for.
    from minisgl_gateway.config import FLAGS as GATEWAY
    from minisgl_scheduler.config import FLAGS as SCHEDULER
    from minisgl_tokenizer.config import DETOKENIZER_FLAGS, TOKENIZER_FLAGS
    from minisgl_worker.config import FLAGS as WORKER

    specs = {s.service: s for s in (WORKER, TOKENIZER_FLAGS, DETOKENIZER_FLAGS, SCHEDULER, GATEWAY)}
    return {name: specs[name] for name in SERVICES}


def all_flags() -> dict[str, list[Flag]]:
    """service -> its flags, in declaration order."""
    return {name: spec.flags() for name, spec in service_flags().items()}


# --- `minisgl serve`: service flags given directly ---------------------------------------------

# Flags the launcher sets for each service itself (the stack's wiring): given directly, they would
# point every service at one port or address, so they are refused with this reason.
WIRED = {
    "--metrics-port": "each service gets a free /metrics port",
    "--worker": "each scheduler is pointed at its own worker",
    "--scheduler": "the gateways are pointed at every scheduler",
    "--tokenizer": "the gateways are pointed at the tokenizer",
    "--detokenizer": "the gateways are pointed at the detokenizer",
}
_DEST = "service_flag:"  # namespace keys of routed flags, apart from the launcher's own


@dataclass(frozen=True)
class RoutedFlag:
    """A flag `minisgl serve` takes and hands, as given, to every service declaring it."""

    option: str
    declared: tuple[Flag, ...]  # one per service declaring it, in SERVICES order

    @property
    def services(self) -> tuple[str, ...]:
        return tuple(f.service for f in self.declared)

    @property
    def dest(self) -> str:
        return _DEST + self.option

    def argv(self, value: Any) -> list[str]:
        """The tokens that give `value` (as the launcher's parser stored it) to a service."""
        kind = self.declared[0].kind
        if kind is bool:
            return [self.option if value else "--no-" + self.option.removeprefix("--")]
        if kind is list:
            return [token for v in value for token in (self.option, v)]
        return [self.option, value]


def routed_flags(launcher_options: set[str]) -> list[RoutedFlag]:
    """Every service flag `minisgl serve` accepts directly: all but those the launcher owns
    (`launcher_options`: the name keeps the launcher's meaning) and the wiring it sets itself."""
    by_option: dict[str, list[Flag]] = {}
    for flags in all_flags().values():
        for f in flags:
            by_option.setdefault(f.option, []).append(f)
    return [RoutedFlag(option, tuple(declared)) for option, declared in by_option.items()
            if option not in launcher_options and option not in WIRED]


class _Checked:
    """Validates a value with the services' type but keeps the text: each service parses it."""

    def __init__(self, kind: type) -> None:
        self.kind, self.__name__ = kind, kind.__name__  # argparse names it in its error

    def __call__(self, text: str) -> str:
        self.kind(text)
        return text


class _Refused(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} is set by minisgl serve itself ({WIRED[self.dest]}); "
                     "to override it anyway, use --<service>-args")


def _help(routed: RoutedFlag) -> str:
    # Of several services' help texts, the last one's: the worker's speaks of how it sizes
    # buffers for a value the scheduler or the tokenizer define.
    defaults = {f.service: f.default for f in routed.declared}
    if len(set(map(repr, defaults.values()))) == 1:
        default = f"default: {routed.declared[0].default}"
    else:
        default = "defaults: " + ", ".join(f"{s} {d}" for s, d in defaults.items())
    return f"{routed.declared[-1].help} ({default})".replace("%", "%%")  # argparse %-formats it


def _metavar(option: str) -> str:
    return option.removeprefix("--").replace("-", "_").upper()


def _title(services: tuple[str, ...]) -> str:
    if len(services) == len(SERVICES):
        return "flags of every service"
    names = services[0] if len(services) == 1 else \
        ", ".join(services[:-1]) + " and " + services[-1]
    return f"flags of the {names}" + (" (given to each)" if len(services) > 1 else "")


def add_service_flags(parser: argparse.ArgumentParser) -> list[RoutedFlag]:
    """Adds every routable service flag to `minisgl serve`'s parser, one help section per set of
    services declaring them; returns them for `route`."""
    own = {o for a in parser._actions for o in a.option_strings}
    for option in WIRED:
        parser.add_argument(option, dest=option, nargs="?", action=_Refused, help=argparse.SUPPRESS)
    routed = routed_flags(own)
    sections: dict[tuple[str, ...], argparse._ArgumentGroup] = {}
    for r in sorted(routed, key=lambda r: (len(r.services) > 1, len(r.services),
                                           [SERVICES.index(s) for s in r.services])):
        if r.services not in sections:
            sections[r.services] = parser.add_argument_group(_title(r.services))
        target, first = sections[r.services], r.declared[0]
        kwargs: dict[str, Any] = {"dest": r.dest, "default": argparse.SUPPRESS, "help": _help(r),
                                  "metavar": first.metavar or _metavar(r.option)}
        if first.kind is bool:
            del kwargs["metavar"]
            target.add_argument(r.option, action=argparse.BooleanOptionalAction, **kwargs)
        elif first.kind is list:
            target.add_argument(r.option, action="append", **kwargs)
        else:
            # Checked here only where every service declaring it agrees on what it accepts.
            if len({f.kind for f in r.declared}) == 1:
                kwargs["type"] = _Checked(first.kind)
            if len({f.choices for f in r.declared}) == 1 and first.choices:
                kwargs["choices"] = list(first.choices)
                kwargs["metavar"] = first.metavar  # None: argparse shows the choices
            target.add_argument(r.option, **kwargs)
    return routed


def route(ns: argparse.Namespace, routed: list[RoutedFlag]) -> dict[str, list[str]]:
    """service -> the flags given directly to `minisgl serve` that it declares."""
    out: dict[str, list[str]] = {name: [] for name in SERVICES}
    given = vars(ns)
    for r in routed:
        if r.dest in given:
            for service in r.services:
                out[service] += r.argv(given[r.dest])
    return out
