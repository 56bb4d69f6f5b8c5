"""The scheduler's flags come from SchedulerConfig: one per field, its help text from the field."""

from __future__ import annotations

from dataclasses import fields

import pytest
from minisgl_scheduler.__main__ import build_parser
from minisgl_scheduler.config import SchedulerConfig


def test_every_config_field_is_a_flag_with_its_help() -> None:
    parser = build_parser().parser()
    actions = {a.dest: a for a in parser._actions}
    for f in fields(SchedulerConfig):
        assert f.metadata["help"], f.name
        action = actions[f.name]
        assert action.help == f.metadata["help"]
        assert action.default == getattr(SchedulerConfig(), f.name)
    assert actions["cache"].choices == ["radix", "naive"]
    assert actions["policy"].choices == ["fcfs", "lpm"]


def test_flags_and_environment_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_SCHEDULER_MAX_PREFILL_TOKENS", "512")
    ns = build_parser().parse(["--policy", "lpm", "--disable-overlap",
                               "--decode-reserve-ratio", "0.5"])
    config = SchedulerConfig(**{f.name: getattr(ns, f.name) for f in fields(SchedulerConfig)})
    config.validate()
    assert (config.policy, config.disable_overlap, config.decode_reserve_ratio,
            config.max_prefill_tokens) == ("lpm", True, 0.5, 512)
    with pytest.raises(SystemExit):
        build_parser().parse(["--cache", "lru"])
