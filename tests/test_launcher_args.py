"""The flags `minisgl serve` gives each service (no process started): the worker gets the
scheduler's prefill chunk, which sizes its TP all-reduce buffer, unless it was given its own."""

from __future__ import annotations

import pytest
from minisgl.launcher import Stack, StackConfig


def _worker_command(monkeypatch: pytest.MonkeyPatch, extra: dict[str, list[str]],
                    env: dict[str, str] | None = None) -> list[str]:
    for name in ("MINISGL_SCHEDULER_MAX_PREFILL_TOKENS", "MINISGL_WORKER_MAX_PREFILL_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    stack = Stack(StackConfig(model_path="m", extra_args=extra, metrics=False,
                              internal_ports={n: 0 for n in ("worker", "tokenizer", "detokenizer",
                                                             "scheduler")}))
    return stack._command("worker")


def _chunk(cmd: list[str]) -> list[str]:
    return [a for i, a in enumerate(cmd) if a.startswith("--max-prefill-tokens")
            or (i and cmd[i - 1] == "--max-prefill-tokens")]


@pytest.mark.parametrize("scheduler", [["--max-prefill-tokens", "16384"],
                                       ["--max-prefill-tokens=16384"]])
def test_the_worker_gets_the_schedulers_prefill_chunk(monkeypatch, scheduler) -> None:
    cmd = _worker_command(monkeypatch, {"scheduler": scheduler, "worker": ["--tp-size", "2"]})
    assert _chunk(cmd) == ["--max-prefill-tokens", "16384"]
    assert cmd[cmd.index("--tp-size") + 1] == "2"  # its own flags kept


def test_the_scheduler_variable_is_mirrored_too(monkeypatch) -> None:
    cmd = _worker_command(monkeypatch, {},
                          env={"MINISGL_SCHEDULER_MAX_PREFILL_TOKENS": "4096"})
    assert _chunk(cmd) == ["--max-prefill-tokens", "4096"]


def test_a_worker_chunk_of_its_own_wins(monkeypatch) -> None:
    cmd = _worker_command(monkeypatch, {"scheduler": ["--max-prefill-tokens", "16384"],
                                        "worker": ["--max-prefill-tokens", "2048"]})
    assert _chunk(cmd) == ["--max-prefill-tokens", "2048"]
    cmd = _worker_command(monkeypatch, {"scheduler": ["--max-prefill-tokens", "16384"]},
                          env={"MINISGL_WORKER_MAX_PREFILL_TOKENS": "2048"})
    assert _chunk(cmd) == []  # the worker reads its own variable


def test_nothing_is_added_by_default(monkeypatch) -> None:
    assert _chunk(_worker_command(monkeypatch, {})) == []
