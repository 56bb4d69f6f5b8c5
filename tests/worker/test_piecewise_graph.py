"""Prefill and mixed steps through the piecewise CUDA graphs' plumbing (engine/piecewise_graph.py):
static inputs, padding to the captured size, the cut at every attention call, the eager
attention on the step's rows between the pieces. No GPU here, so the pieces run eagerly
(`eager=True`), exactly as a replay orders them; the captures themselves run in tests/gpu."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.engine.piecewise_graph import PiecewiseGraphs, piecewise_sizes  # noqa: E402
from minisgl_worker.kernels import fused_ops  # noqa: E402

# _run: three requests in chunks of 8 prompt tokens next to decodes, i.e. prefill, chunked and
# mixed steps of 3-13 tokens.
from .driver import run_requests  # noqa: E402
from .test_fused_prologue_plumbing import PS, _run  # noqa: E402


def test_sizes_pad_little_and_end_at_the_maximum() -> None:
    assert piecewise_sizes(2048)[:7] == [16, 32, 64, 96, 128, 192, 256]
    sizes = piecewise_sizes(2048)
    assert sizes[-1] == 2048 and sizes == sorted(set(sizes)) and len(sizes) == 23
    long = [s for s in sizes if s >= 512]
    assert all(b / a <= 1.25 for a, b in zip(long, long[1:], strict=False))
    assert piecewise_sizes(100) == [16, 32, 64, 96, 100] and piecewise_sizes(1) == [1]


def _engine(path, backend: str, pieces: bool):
    from minisgl_worker.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model_path=str(path), attention_backend=backend, page_size=PS,
                                 max_slots=4, num_pages=64, max_model_len=128,
                                 hf_overrides={"num_hidden_layers": 2}))
    assert engine.piecewise is None  # built on CUDA only
    if pieces:
        engine.piecewise = PiecewiseGraphs(engine.model, engine.backend, engine.pool,
                                           max_tokens=24, eager=True)
    return engine


@pytest.fixture(scope="module")
def plain_tokens(tiny_model_path) -> list[list[int]]:
    return _run(_engine(tiny_model_path, "torch", pieces=False))


@pytest.mark.parametrize("backend, fused", [("torch", False), ("triton", True)])
def test_pieces_give_the_tokens_and_cache_of_eager_steps(tiny_model_path, plain_tokens,
                                                         monkeypatch, backend, fused) -> None:
    """Greedy tokens and every live KV page (within rounding) as without pieces, both where
    the layers store K/V themselves at the static store location (fused prologue, as on
    CUDA) and where the backend stores the stashed k/v; padding rows write only into the
    dummy page."""
    if fused:
        monkeypatch.setattr(fused_ops, "usable", lambda x: True)
    plain = _engine(tiny_model_path, backend, pieces=False)
    want = _run(plain)
    assert want == plain_tokens
    engine = _engine(tiny_model_path, backend, pieces=True)
    pw = engine.piecewise
    assert pw.sizes == [16, 24]
    assert _run(engine) == want
    assert pw.replays > 0  # every prefill and mixed step went through the pieces
    dummy = engine.pool.dummy_page
    for a, b in zip(engine.pool.k + engine.pool.v, plain.pool.k + plain.pool.v, strict=True):
        live = [p for p in range(a.shape[0]) if p != dummy]
        # fp32 GEMMs over 16 or 24 rows round unlike over the step's own rows (7.7e-7 seen)
        torch.testing.assert_close(a[live], b[live], rtol=1e-5, atol=1e-5)
    # the static store location: live slots for the last step's rows, the dummy page after
    assert bool((pw.loc[16:] == dummy * PS).all())


def _graphs_of_steps(engine) -> list[str]:
    """Record `StepOutput.graph` of every step the engine answers (the worker's metric)."""
    seen: list[str] = []
    collect = engine.collect

    def spy():  # noqa: ANN202
        out = collect()
        seen.append(out.graph)
        return out

    engine.collect = spy
    return seen


def test_steps_past_the_largest_size_and_decode_steps_stay_eager(tiny_model_path) -> None:
    engine = _engine(tiny_model_path, "torch", pieces=True)
    pw = engine.piecewise
    long_prompt = [[(3 * i + 1) % 4000 for i in range(40)]]
    plain = _engine(tiny_model_path, "torch", pieces=False)
    want = run_requests(plain, long_prompt, 3, PS, chunk=40)
    graphs = _graphs_of_steps(engine)
    assert run_requests(engine, long_prompt, 3, PS, chunk=40) == want
    assert pw.replays == 0  # 40 tokens > 24; the decode steps are not the pieces' either
    assert graphs == ["eager"] * 3  # each step says how it ran
    short = run_requests(engine, [long_prompt[0][:20]], 3, PS, chunk=20)
    assert pw.replays == 1 and graphs[3:] == ["piecewise", "eager", "eager"] and len(short[0]) == 3
    with pytest.raises(ValueError, match="exceeds the largest size"):
        pw.size_for(25)


def test_the_flag_reaches_the_config_and_refuses_negative_sizes() -> None:
    from minisgl_worker.__main__ import build_parser, config_from_args
    from minisgl_worker.engine import EngineConfig

    assert EngineConfig(model_path="unused").piecewise_max_tokens == 2048
    with pytest.raises(ValueError, match="piecewise_max_tokens must be >= 0"):
        EngineConfig(model_path="unused", piecewise_max_tokens=-1)
    ns = build_parser().parse(["--model", "m", "--piecewise-max-tokens", "0"])
    assert config_from_args(ns).piecewise_max_tokens == 0
