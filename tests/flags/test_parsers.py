"""The parsers generated from dataclass fields (minisgl_core.flags): the environment fallback, flags
winning over it, boolean variables, groups; and every service's parser against the snapshot taken
before the declarations moved (service_flags.json: names, defaults, types, choices, variables)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import pytest
from minisgl_core.flags import ServerFlags, ServiceFlags, flag, group

from tests.flags.snapshot import SNAPSHOT, current


@dataclass
class _Inner:
    depth: int = flag(3, "a nested flag", option="--inner-depth")


@dataclass
class _Toy:
    size: int = flag(8, "an int")
    ratio: float = flag(0.5, "a float")
    mode: Literal["a", "b"] = flag("a", "a Literal: its values are the choices")
    verbose: bool = flag(False, "a boolean")
    name: str | None = flag(None, "optional", env_fallback="MINISGL_SHARED_NAME")
    keys: list[str] = flag(default_factory=list, help="repeatable", option="--key",
                           env="MINISGL_TOY_KEYS")
    inner: _Inner = group(_Inner, "inner")


TOY = ServiceFlags("toy", "a test service", (ServerFlags, _Toy), defaults={"port": 1234})


@pytest.fixture(autouse=True)
def _no_minisgl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("MINISGL_")]:
        monkeypatch.delenv(name)


def test_defaults_types_and_a_service_default() -> None:
    ns = TOY.parse([])
    assert (ns.size, ns.ratio, ns.mode, ns.verbose, ns.name, ns.keys, ns.depth, ns.port) == \
        (8, 0.5, "a", False, None, [], 3, 1234)
    ns = TOY.parse(["--size", "9", "--ratio", "2", "--mode", "b", "--verbose", "--key", "k1",
                    "--key", "k2", "--inner-depth", "4"])
    toy = TOY.build(_Toy, ns)
    assert toy == _Toy(size=9, ratio=2.0, mode="b", verbose=True, keys=["k1", "k2"],
                       inner=_Inner(depth=4))
    with pytest.raises(SystemExit):
        TOY.parse(["--mode", "c"])
    with pytest.raises(SystemExit):
        TOY.parse(["--size", "x"])


def test_the_environment_is_the_default_and_a_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_TOY_SIZE", "16")
    monkeypatch.setenv("MINISGL_TOY_INNER_DEPTH", "5")
    monkeypatch.setenv("MINISGL_TOY_KEYS", "a, b,")
    ns = TOY.parse([])
    assert (ns.size, ns.depth, ns.keys) == (16, 5, ["a", "b"])
    ns = TOY.parse(["--size", "4", "--inner-depth", "6", "--key", "c"])
    assert (ns.size, ns.depth, ns.keys) == (4, 6, ["c"])


def test_a_services_own_variable_comes_before_the_shared_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_SHARED_NAME", "shared")
    monkeypatch.setenv("MINISGL_LOG_LEVEL", "debug")
    assert (TOY.parse([]).name, TOY.parse([]).log_level) == ("shared", "debug")
    monkeypatch.setenv("MINISGL_TOY_NAME", "own")
    monkeypatch.setenv("MINISGL_TOY_LOG_LEVEL", "error")
    assert (TOY.parse([]).name, TOY.parse([]).log_level) == ("own", "error")
    assert TOY.parse(["--log-level", "warning"]).log_level == "warning"


@pytest.mark.parametrize(("value", "expected"), [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("no", False), ("", False), ("2", False)])
def test_boolean_variables(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("MINISGL_TOY_VERBOSE", value)
    assert TOY.parse([]).verbose is expected
    assert TOY.parse(["--no-verbose"]).verbose is False
    assert TOY.parse(["--verbose"]).verbose is True


def test_a_flag_needs_a_type_it_can_parse() -> None:
    @dataclass
    class Bad:
        table: dict[str, int] = flag(default_factory=dict, help="no flag type")

    with pytest.raises(TypeError, match="kind="):
        ServiceFlags("bad", "", (Bad,)).flags()
    with pytest.raises(ValueError, match="defaults for no flag"):
        ServiceFlags("bad", "", (), defaults={"nope": 1}).flags()


def test_the_gateways_api_keys_come_from_the_flag_or_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl_gateway.config import parse_config

    assert parse_config([]).api_keys == []
    monkeypatch.setenv("MINISGL_GATEWAY_API_KEYS", "k1,k2")
    assert parse_config([]).api_keys == ["k1", "k2"]
    assert parse_config(["--api-key", "x"]).api_keys == ["x"]
    config = parse_config(["--retry-after", "3", "--routing", "least_load",
                           "--routing-balance-threshold", "-1", "--header-timeout", "0"])
    assert (config.limits.retry_after_s, config.routing.policy,
            config.routing.balance_threshold, config.limits.header_timeout_s) == \
        (3, "least_load", 0.0, 0.1)
    with pytest.raises(SystemExit):
        parse_config(["--retry-after", "0"])


def test_every_services_flags_match_the_snapshot() -> None:
    """A flag's name, default, type, choices or variable changed: deliberate changes update the
    snapshot (`python -m tests.flags.snapshot --write`), and the Helm chart, compose file and
    docs that use the flag."""
    expected = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(current()))  # tuples as lists, as in the file
    for service in expected:
        assert sorted(got[service]) == sorted(expected[service]), service
        for option, facts in expected[service].items():
            assert got[service][option] == facts, (
                f"{service} {option} changed; if on purpose: python -m tests.flags.snapshot "
                "--write")
