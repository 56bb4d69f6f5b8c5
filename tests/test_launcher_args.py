"""The flags `minisgl serve` gives each service (no process started): a service flag given
directly goes to every service declaring it, a `--<service>-args` string wins over it, the
launcher's own flags keep their meaning, and a flag no service declares is refused by name.
Each service's command is read back with that service's own parser."""

from __future__ import annotations

import argparse
import os

import pytest
from minisgl.cli import parse_args, stack_config
from minisgl.flags import service_flags
from minisgl.launcher import Stack

SERVICES = ("worker", "tokenizer", "detokenizer", "scheduler", "gateway")


@pytest.fixture(autouse=True)
def _no_minisgl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("MINISGL_")]:
        monkeypatch.delenv(name)


def _parsed(argv: list[str]) -> dict[str, argparse.Namespace]:
    """service -> the namespace its own parser makes of the command `minisgl serve` runs."""
    args, routed, _ = parse_args(["serve", *argv])
    config = stack_config(args, routed)
    config.metrics = False
    config.internal_ports = {n: 0 for n in ("worker", "tokenizer", "detokenizer", "scheduler")}
    stack, specs, out = Stack(config), service_flags(), {}
    for name in SERVICES:
        command = stack._command(name)
        start = command.index("minisgl_tokenizer") + 2 if "minisgl_tokenizer" in command else 3
        out[name] = specs[name].parser().parse_args(command[start:])
    return out


def test_a_flag_goes_to_every_service_that_declares_it() -> None:
    ns = _parsed(["--max-prefill-tokens", "4096", "--kv-cache-dtype", "fp8_e4m3",
                  "--tool-call-parser=hermes", "--max-model-len", "1024", "--policy", "lpm"])
    assert (ns["scheduler"].max_prefill_tokens, ns["worker"].max_prefill_tokens) == (4096, 4096)
    assert ns["worker"].kv_cache_dtype == "fp8_e4m3"
    assert ns["gateway"].tool_call_parser == "hermes"
    assert ns["scheduler"].policy == "lpm"
    assert [ns[s].max_model_len for s in ("worker", "tokenizer", "detokenizer")] == [1024] * 3


def test_only_those_services_get_it() -> None:
    args, routed, _ = parse_args(["serve", "--max-prefill-tokens", "4096",
                                  "--kv-cache-dtype", "fp8_e4m3"])
    extra = stack_config(args, routed).extra_args
    assert extra["worker"] == ["--kv-cache-dtype", "fp8_e4m3", "--max-prefill-tokens", "4096"]
    assert extra["scheduler"] == ["--max-prefill-tokens", "4096"]
    assert extra["gateway"] == extra["tokenizer"] == extra["detokenizer"] == []


def test_booleans_and_repeatable_flags() -> None:
    ns = _parsed(["--sticky-sessions", "--no-disable-overlap", "--disable-cuda-graph",
                  "--api-key", "a", "--api-key", "b"])
    assert ns["gateway"].sticky_sessions is True
    assert ns["scheduler"].disable_overlap is False
    assert ns["worker"].disable_cuda_graph is True
    assert ns["gateway"].api_keys == ["a", "b"]


def test_a_per_service_string_wins_over_a_direct_flag() -> None:
    ns = _parsed(["--max-prefill-tokens", "4096", "--worker-args", "--max-prefill-tokens 2048",
                  "--drain-timeout", "5", "--gateway-args=--drain-timeout=7"])
    assert (ns["scheduler"].max_prefill_tokens, ns["worker"].max_prefill_tokens) == (4096, 2048)
    assert [ns[s].drain_timeout for s in SERVICES] == [5.0, 5.0, 5.0, 5.0, 7.0]


def test_a_per_service_string_reaches_only_its_service() -> None:
    ns = _parsed(["--scheduler-args", "--max-prefill-tokens 16384"])
    assert (ns["scheduler"].max_prefill_tokens, ns["worker"].max_prefill_tokens) == (16384, None)


def test_the_launchers_own_flags_keep_their_meaning() -> None:
    ns = _parsed(["--model", "/m", "--port", "9000", "--grpc-port", "9001", "--host", "0.0.0.0",
                  "--log-level", "debug"])
    assert (ns["gateway"].port, ns["gateway"].grpc_port, ns["gateway"].host) == \
        (9000, 9001, "0.0.0.0")
    for name in ("worker", "tokenizer", "detokenizer", "scheduler"):
        assert ns[name].host == "127.0.0.1" and ns[name].port not in (9000, 9001), name
    assert ns["worker"].model_path == ns["tokenizer"].model == "/m"
    assert {ns[s].log_level for s in SERVICES} == {"debug"}


def test_nothing_is_added_by_default() -> None:
    args, routed, _ = parse_args(["serve"])
    assert stack_config(args, routed).extra_args == {s: [] for s in SERVICES}


@pytest.mark.parametrize("argv", [["--no-such-flag", "1"], ["--max-prefill-tokenz=1"]])
def test_a_flag_no_service_declares_is_refused_by_name(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["serve", *argv])
    assert exit_.value.code == 2
    assert argv[0].split("=")[0] in capsys.readouterr().err.split("declares")[1]


@pytest.mark.parametrize("argv", [["--max-prefill-tokens", "many"], ["--cache", "lru"],
                                  ["--metrics-port", "9100"], ["--worker", "10.0.0.1:1"]])
def test_bad_values_and_the_launchers_wiring_are_refused(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", *argv])
    assert argv[0] in capsys.readouterr().err


def test_help_lists_the_service_flags_by_service(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for section, option in [("flags of the worker:", "--kv-cache-dtype"),
                            ("flags of the gateway:", "--tool-call-parser"),
                            ("flags of the worker and scheduler (given to each):",
                             "--max-prefill-tokens")]:
        assert option in out.split(section)[1].split("\n\n")[0], section


def test_shell_does_not_build_the_service_flags() -> None:
    args, routed, rest = parse_args(["shell", "--url", "http://x"])
    assert (args.command, routed, rest) == ("shell", [], ["--url", "http://x"])
