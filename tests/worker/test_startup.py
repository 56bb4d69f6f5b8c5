"""A rank's start-up steps (engine/startup.py), each run alone on the CPU, and the runner's
warm-up on the tiny trained model (models/tiny)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from minisgl_core.sampling import SamplingParams
from minisgl_worker.attention import BackendUnavailable, describe
from minisgl_worker.attention.kv_pool import KVPool
from minisgl_worker.config import EngineConfig
from minisgl_worker.engine import startup
from minisgl_worker.engine.runner import ModelRunner
from minisgl_worker.model_config import ModelConfig
from minisgl_worker.sampling.params import ParamRow

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
CPU = torch.device("cpu")
GiB = 2**30


def _config(**kw: object) -> EngineConfig:
    return EngineConfig(model_path=str(TINY), device="cpu", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mc() -> ModelConfig:
    return startup.load_model_config(_config())


def test_kv_budget_is_the_fraction_less_what_is_in_use() -> None:
    # 10 GiB device, 3 GiB in use (weights...), 90% may be used: 9 - 3 = 6 GiB for the cache.
    assert startup.kv_budget_bytes(free=7 * GiB, total=10 * GiB, mem_fraction=0.9) == 6 * GiB
    assert startup.kv_budget_bytes(free=GiB, total=10 * GiB, mem_fraction=0.5) < 0


def test_kv_cache_sized_from_a_memory_budget(mc: ModelConfig) -> None:
    per_page = KVPool.bytes_per_page(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim,
                                     torch.bfloat16)
    pages = startup.size_kv_cache(_config(mem_fraction=0.5), mc, mc.num_kv_heads, 16,
                                  torch.bfloat16, CPU, memory=(3 * GiB, 4 * GiB))
    assert pages == GiB // per_page  # 2 GiB allowed, 1 GiB in use
    with pytest.raises(RuntimeError, match="no GPU memory left for the KV cache"):
        startup.size_kv_cache(_config(mem_fraction=0.5), mc, mc.num_kv_heads, 16,
                              torch.bfloat16, CPU, memory=(GiB, 4 * GiB))


def test_kv_cache_sized_by_count_or_tokens_without_memory_figures(mc: ModelConfig) -> None:
    assert startup.size_kv_cache(_config(num_pages=7), mc, 2, 16, torch.bfloat16, CPU,
                                 memory=(0, GiB)) == 7  # an explicit count wins
    assert startup.size_kv_cache(_config(kv_cache_tokens=100), mc, 2, 16, torch.bfloat16,
                                 CPU) == 7  # ceil(100 / 16)


def test_backend_choice_on_the_cpu(mc: ModelConfig) -> None:
    config = _config(num_pages=4)
    _, kv_heads = startup.shard_heads(mc)
    pool = startup.make_kv_pool(config, mc, kv_heads, 4, 16, 64, torch.float32, CPU)
    assert (pool.num_pages, pool.max_pages_per_seq, pool.page_table.shape) == (
        4, 4, (config.max_slots, 4))
    backend = startup.choose_backend(config, mc, mc.num_heads, pool, 64, torch.float32)
    assert describe(backend) == "torch"  # "auto" on a CPU
    startup.check_backend_names(config, CPU)
    with pytest.raises(BackendUnavailable, match="unknown attention backend"):  # before loading
        startup.check_backend_names(_config(attention_backend="no-such-backend"), CPU)


def test_model_config_and_context_length(mc: ModelConfig) -> None:
    assert startup.context_length(_config(), mc) == mc.max_position_embeddings
    assert startup.context_length(_config(max_model_len=100), mc) == 100
    windowed = startup.load_model_config(_config(hf_overrides={
        "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 0}))
    # windows are computed, not a cap on the context
    assert startup.context_length(_config(), windowed) == windowed.max_position_embeddings
    assert windowed.layer_window(0) == 64 and mc.layer_window(0) is None
    # EOS ids past an overridden vocabulary are dropped (the tiny model's are 0 and 2).
    small = startup.load_model_config(_config(hf_overrides={"vocab_size": 2}))
    assert sorted(mc.eos_token_ids) == [0, 2] and small.eos_token_ids == [0]


def test_cpu_steps_that_do_nothing(mc: ModelConfig) -> None:
    """TP 1 on a CPU: no fast all-reduce, no vocabulary shard, no graphs."""
    config = _config()
    assert startup.init_fast_all_reduce(config, mc, CPU, torch.float32) == 0
    assert startup.choose_vocab_shard(config, mc) is None
    pool = startup.make_kv_pool(config, mc, mc.num_kv_heads, 4, 16, 64, torch.float32, CPU)
    backend = startup.choose_backend(config, mc, mc.num_heads, pool, 64, torch.float32)
    model = torch.nn.Module()
    assert startup.capture_decode_graphs(config, model, backend, pool, None) is None  # type: ignore[arg-type]
    assert startup.capture_piecewise_graphs(config, model, backend, pool) is None  # type: ignore[arg-type]


def test_sampler_of_the_model(mc: ModelConfig) -> None:
    sampler = startup.make_sampler(_config(max_slots=3, sampler_seed=1), mc, CPU)
    assert (sampler.max_slots, sampler.vocab_size) == (3, 4096)
    assert sampler.eos_token_ids == mc.eos_token_ids
    assert sampler.grammars.compiler.tokenizer_path == str(TINY / "tokenizer.json")


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    config, device = startup.prepare_rank(_config(page_size=4, num_pages=64, max_slots=2,
                                                   dtype="float32"))
    r = ModelRunner(config, device)
    yield r
    r.release()


def test_warm_up_runs_one_prefill_a_size_and_leaves_slot_0_as_it_was(
        runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Throwaway prefills of 5 and 12 tokens through slot 0, then the sampler's three paths
    (greedy, temperature, fp32); slot 0 ends with no pages, no token future and default
    seeded sampling parameters."""
    sizes: list[int] = []
    forward = runner._forward

    def counting(step, use_graph=True):  # noqa: ANN001, ANN202
        sizes.append(int(step.input_ids.shape[0]))
        return forward(step, use_graph)

    monkeypatch.setattr(runner, "_forward", counting)
    draws: list[float] = []
    draw = runner._draw

    def drawing(logits, slots, positions, host):  # noqa: ANN001, ANN202
        draws.append(float(runner.sampler.slots.host_np.temperature[0]))
        return draw(logits, slots, positions, host)

    monkeypatch.setattr(runner, "_draw", drawing)
    with torch.inference_mode():  # as in a step: the warm-up made inference tensors
        runner.sampler.set_slot(0, SamplingParams(temperature=0.3, seed=4))
    assert runner.warm_up_prefill((12, 5)) >= 0
    assert sizes == [5, 12]
    assert draws == pytest.approx([0.0, 0.7, 0.7])
    b = runner.builder
    assert (int(b.pages_len[0]), bool(b.has_future[0])) == (0, False)
    default = ParamRow.of(SamplingParams(seed=0), 0)  # what a request's first chunk replaces
    assert runner.sampler.slots.host.floats[0].tolist() == default.floats().tolist()
    assert runner.sampler.slots.host.ints[0].tolist() == default.ints().tolist()


def test_warm_up_fits_a_small_cache(runner: ModelRunner,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill longer than the cache holds is cut to what it holds (64 pages x 4 tokens)."""
    sizes: list[int] = []
    forward = runner._forward
    monkeypatch.setattr(runner, "_forward", lambda step, use_graph=True: (
        sizes.append(int(step.input_ids.shape[0])), forward(step, use_graph))[1])
    runner.warm_up_prefill((1000,))
    assert sizes == [256]


def test_window_pool_sizing(mc: ModelConfig) -> None:
    """Sliding-window layers get their own pool: sized for every slot's window and a prefill
    chunk (twice, half for cached windows), the rest of the budget to the full-attention layers;
    a model without windows (or windows as long as the context) has none."""
    from dataclasses import replace

    assert startup.window_layout(mc, 256) == startup.WindowLayout()
    layers = mc.num_layers
    types = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (
        layers % 2)
    mixed = replace(mc, sliding_window=32, layer_types=types)
    layout = startup.window_layout(mixed, 256)
    assert layout.window == 32 and layout.layers == frozenset(range(0, layers, 2))
    assert startup.window_layout(mixed, 32) == startup.WindowLayout()  # window >= context
    config = _config(mem_fraction=0.5, max_slots=4, max_prefill_tokens=64)
    want = startup.window_pages_wanted(config, layout, 16)
    assert want == 2 * (4 * (2 + 3) + 2 * 4)
    kw = dict(kv_heads=mc.num_kv_heads, page_size=16, kv_dtype=torch.bfloat16, device=CPU,
              layout=layout, max_model_len=256)
    pages, win = startup.size_kv_pools(config, mixed, memory=(3 * GiB, 4 * GiB), **kw)
    full_b = KVPool.bytes_per_page(layers - len(layout.layers), 16, mc.num_kv_heads,
                                   mc.head_dim, torch.bfloat16)
    win_b = KVPool.bytes_per_page(len(layout.layers), 16, mc.num_kv_heads, mc.head_dim,
                                  torch.bfloat16)
    assert win == want and pages == (GiB - want * win_b) // full_b
    small = (GiB // 2 + want * (full_b + win_b) // 2, GiB)  # a budget for fewer than `want`
    pages, win = startup.size_kv_pools(config, mixed, memory=small, **kw)
    assert pages == win < want
    # no windows: the main pool alone, as size_kv_cache sizes it
    plain = startup.size_kv_pools(config, mc, memory=(3 * GiB, 4 * GiB),
                                  **{**kw, "layout": startup.WindowLayout()})
    assert plain == (startup.size_kv_cache(config, mc, mc.num_kv_heads, 16, torch.bfloat16,
                                           CPU, memory=(3 * GiB, 4 * GiB)), 0)
    # CPU / explicit counts: the window pool is `want`, at most the main pool
    assert startup.size_kv_pools(_config(num_pages=7, max_slots=4), mixed, **kw) == (7, 7)
    pool = startup.make_kv_pool(config, mixed, mc.num_kv_heads, 64, 16, 256, torch.float32, CPU,
                                layout, 10)
    assert pool.k[0].shape[0] == 11 and pool.k[1].shape[0] == 65 and pool.windowed(0)
