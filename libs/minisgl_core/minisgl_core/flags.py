"""A service's flags, declared once as dataclass fields; the argparse parser, the flag table in
docs/operations.md and `minisgl serve`'s routing are all built from the same declarations.

    @dataclass
    class SchedulerConfig:
        max_prefill_tokens: int = flag(8192, "prompt tokens computed per step")

is the flag `--max-prefill-tokens` (type int, from the annotation) of every service that lists
`SchedulerConfig` among its sections. When the flag is not given, the parser's default comes from
the first set variable of `Flag.env` (by default MINISGL_<SERVICE>_<FLAG>), else the field's
default: flags always win over the environment. A field made with `group(Cls, "title")` nests
`Cls`'s flags under a help section and builds a `Cls` back (`ServiceFlags.build`).
"""

from __future__ import annotations

import argparse
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from minisgl_core import logging as core_logging
from minisgl_core.config import env_name, parse_bool, version
from minisgl_core.metrics_compat import MODES as COMPAT_MODES
from minisgl_core.metrics_compat import set_compat

FLAG_KEY, GROUP_KEY = "minisgl_flag", "minisgl_flag_group"
LOG_LEVELS = ("debug", "info", "warning", "error")
T = TypeVar("T")


class _Unset:
    """No parser default of its own (dataclasses.MISSING cannot be a dataclass field's default)."""


_UNSET: Any = _Unset()


@dataclass(frozen=True)
class FlagMeta:
    """What a field's annotation and default do not say about its flag."""

    help: str
    option: str | None = None  # None: "--" + the field's name, dashed
    env: tuple[str, ...] | None = None  # None: MINISGL_<SERVICE>_<FLAG>
    env_fallback: str | None = None  # read when the variables of `env` are unset
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    kind: type | None = None  # the parsed type where the annotation is not one (a JSON string)
    parser_default: Any = _UNSET  # the parser's default where the field's is not a flag value


def flag(default: Any = MISSING, help: str = "", *, default_factory: Callable[[], Any] | None = None,
         option: str | None = None, env: str | tuple[str, ...] | None = None,
         env_fallback: str | None = None, choices: tuple[str, ...] | list[str] | None = None,
         metavar: str | None = None, kind: type | None = None,
         parser_default: Any = _UNSET) -> Any:
    """A dataclass field that is also a flag. `help` is also kept as metadata["help"]: a field's
    description for readers of the dataclass that know nothing of flags."""
    meta = FlagMeta(help=help, option=option, env=(env,) if isinstance(env, str) else env,
                    env_fallback=env_fallback, choices=tuple(choices) if choices else None,
                    metavar=metavar, kind=kind, parser_default=parser_default)
    metadata = {FLAG_KEY: meta, "help": help}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def group(cls: type, title: str) -> Any:
    """A field holding a nested settings dataclass whose fields are flags (a help section)."""
    return field(default_factory=cls, metadata={GROUP_KEY: title})


@dataclass(frozen=True)
class Flag:
    """One flag of one service, as the parser, the docs table and `minisgl serve` see it."""

    service: str
    option: str  # "--max-prefill-tokens"
    dest: str  # the field's name: the attribute of the parsed namespace
    kind: type  # int, float, str, bool, or list (a repeatable flag)
    default: Any  # the declared default, before the environment
    help: str
    env: tuple[str, ...]  # variables read when the flag is not given, the first set one wins
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    section: str | None = None  # a group's help title; None: the service's own flags

    def from_env(self, environ: Mapping[str, str]) -> Any:
        """The parser's default: the first set variable of `env`, converted, else `default`."""
        for name in self.env:
            value = environ.get(name)
            if value is None:
                continue
            if self.kind is bool:
                return parse_bool(value)
            if self.kind is list:
                return [v.strip() for v in value.split(",") if v.strip()]
            return self.kind(value)
        return self.default


def _flag_type(hint: Any) -> tuple[type, tuple[str, ...] | None]:
    """The parsed type of an annotation (`int | None` -> int) and a Literal's values."""
    origin = get_origin(hint)
    if origin is Literal:
        return str, tuple(str(a) for a in get_args(hint))
    if origin in (Union, types.UnionType):
        return _flag_type(next(a for a in get_args(hint) if a is not type(None)))
    if origin is list:
        return list, None
    if isinstance(hint, type) and hint in (int, float, str, bool):
        return hint, None
    raise TypeError(f"no flag type for the annotation {hint!r} (give kind=)")


def _declared_default(f: Field[Any], meta: FlagMeta) -> Any:
    if meta.parser_default is not _UNSET:
        return meta.parser_default
    if f.default is not MISSING:
        return f.default
    return None  # a required field, or one made by a factory (a repeatable flag)


def section_flags(service: str, cls: type, defaults: Mapping[str, Any],
                  section: str | None = None) -> list[Flag]:
    """The flags that `cls`'s fields declare for `service`, groups included."""
    hints = get_type_hints(cls)
    out: list[Flag] = []
    for f in fields(cls):
        if GROUP_KEY in f.metadata:
            out += section_flags(service, hints[f.name], defaults, f.metadata[GROUP_KEY])
            continue
        meta: FlagMeta | None = f.metadata.get(FLAG_KEY)
        if meta is None:
            continue
        kind, literal = _flag_type(hints[f.name]) if meta.kind is None else (meta.kind, None)
        option = meta.option or "--" + f.name.replace("_", "-")
        env = meta.env if meta.env is not None else (env_name(service, option.lstrip("-")),)
        if meta.env_fallback:
            env = (*env, meta.env_fallback)
        default = defaults.get(f.name, _declared_default(f, meta))
        out.append(Flag(service, option, f.name, kind, default, meta.help, env,
                        meta.choices or literal, meta.metavar, section))
    return out


def log_level_flag() -> Any:
    return flag("info", "log level", env_fallback="MINISGL_LOG_LEVEL", choices=LOG_LEVELS)


def internal_token_file_flag() -> Any:
    # One variable for every service, so that one setting covers a whole deployment.
    return flag("", "file holding the shared token every internal RPC carries (env "
                "MINISGL_INTERNAL_TOKEN_FILE; '': no token)", env="MINISGL_INTERNAL_TOKEN_FILE",
                metavar="PATH")


def internal_tls_dir_flag() -> Any:
    return flag("", "mTLS between services: DIR holds ca.crt, tls.crt, tls.key (env "
                "MINISGL_INTERNAL_TLS_DIR; '': plaintext)", env="MINISGL_INTERNAL_TLS_DIR",
                metavar="DIR")


@dataclass
class CommonFlags:
    """Every service's process-wide switches (`ServiceFlags.parse` applies them)."""

    metrics_compat: str = flag("off", "also export metrics under another server's names "
                               "('vllm': vllm:* for vLLM's dashboards and routers; env "
                               "MINISGL_METRICS_COMPAT)", env="MINISGL_METRICS_COMPAT",
                               choices=tuple(COMPAT_MODES))
    log_format: str = flag("auto", "text or json lines; auto: text on a terminal, json otherwise "
                           "(env MINISGL_LOG_FORMAT)", env="MINISGL_LOG_FORMAT",
                           choices=tuple(core_logging.LOG_FORMATS))


@dataclass
class ServerFlags:
    """The listener, security and lifecycle flags of the internal services."""

    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(0, "gRPC port")  # each service's ServiceFlags.defaults gives its port
    metrics_port: int = flag(0, "Prometheus /metrics port (0: off)")
    metrics_host: str = flag("", "address of the /metrics listener ('': as --host)")
    internal_token_file: str = internal_token_file_flag()
    internal_tls_dir: str = internal_tls_dir_flag()
    # Without a token or mTLS, a service on a non-loopback --host refuses to start unless told.
    insecure: bool = flag(False, "serve internal RPCs without a token or mTLS on a non-loopback "
                          "--host (anyone who reaches the port can call them)")
    reflection: bool = flag(False, "gRPC server reflection (lists every method; behind the "
                            "token or mTLS when one is on)")
    log_level: str = log_level_flag()
    drain_timeout: float = flag(30.0, "seconds to finish in-flight work on SIGTERM")


@dataclass(frozen=True)
class ServiceFlags:
    """A service's flags: the sections (dataclasses) declaring them, after `CommonFlags`, and
    the defaults this service gives shared fields (its ports)."""

    service: str
    description: str
    sections: tuple[type, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def flags(self) -> list[Flag]:
        out: list[Flag] = []
        for cls in (CommonFlags, *self.sections):
            out += section_flags(self.service, cls, self.defaults)
        unknown = set(self.defaults) - {f.dest for f in out}
        if unknown:
            raise ValueError(f"{self.service}: defaults for no flag: {sorted(unknown)}")
        return out

    def parser(self, environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
        environ = os.environ if environ is None else environ
        parser = argparse.ArgumentParser(
            prog=f"minisgl-{self.service}", description=self.description,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
            epilog=f"Every flag --x-y may also be set as MINISGL_{self.service.upper()}_X_Y.")
        parser.add_argument("--version", action="version",
                            version=f"minisgl-{self.service} {version()}")
        sections: dict[str, argparse._ArgumentGroup] = {}
        for f in self.flags():
            target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
            if f.section is not None:
                target = sections.setdefault(f.section, parser.add_argument_group(f.section))
            _add(target, f, environ)
        return parser

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        flags = self.flags()
        ns = self.parser().parse_args(argv)
        for f in flags:  # a repeatable flag not given: its variable, else its default
            if f.kind is list and getattr(ns, f.dest) is None:
                setattr(ns, f.dest, f.from_env(os.environ) or [])
        set_compat(ns.metrics_compat)  # process-wide, like the metrics registry it extends
        # setup_logging reads it from there, so each service's main needs no change for it.
        core_logging.default_format = ns.log_format
        return ns

    @staticmethod
    def build(cls: type[T], ns: argparse.Namespace) -> T:
        """A `cls` (a section) from parsed flags; its groups are built the same way."""
        assert is_dataclass(cls)
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if GROUP_KEY in f.metadata:
                values[f.name] = ServiceFlags.build(hints[f.name], ns)
            elif FLAG_KEY in f.metadata:
                values[f.name] = getattr(ns, f.name)
        return cls(**values)


def _add(target: argparse.ArgumentParser | argparse._ArgumentGroup, f: Flag,
         environ: Mapping[str, str]) -> None:
    if f.kind is bool:
        target.add_argument(f.option, dest=f.dest, default=f.from_env(environ),
                            action=argparse.BooleanOptionalAction, help=f.help)
    elif f.kind is list:
        # None until parsed: a flag given replaces the variable rather than adding to it.
        target.add_argument(f.option, dest=f.dest, action="append", default=None,
                            metavar=f.metavar, help=f.help)
    else:
        target.add_argument(f.option, dest=f.dest, default=f.from_env(environ), type=f.kind,
                            choices=list(f.choices) if f.choices else None, metavar=f.metavar,
                            help=f.help)
