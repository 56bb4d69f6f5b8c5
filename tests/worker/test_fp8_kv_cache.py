"""An fp8 KV cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`): the flag, the pool's storage and
saturation, and the model's logits over a cache of fp8 prefixes against a full-precision one.
The backends' fp8 reads are checked in test_triton_backend / test_flashinfer_engine."""

from __future__ import annotations

import pytest
import torch
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker.__main__ import build_parser, config_from_args
from minisgl_worker.attention.kv_pool import KVPool
from minisgl_worker.engine import Engine, EngineConfig

from .tiny_models import VOCAB

CPU = torch.device("cpu")
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def test_flag_and_config() -> None:
    ns = build_parser().parse(["--model", "m", "--kv-cache-dtype", "fp8_e4m3"])
    cfg = config_from_args(ns)
    assert cfg.kv_cache_dtype == "fp8_e4m3"
    assert cfg.torch_kv_dtype(CPU) == torch.float8_e4m3fn
    assert EngineConfig(model_path="m").torch_kv_dtype(CPU) == torch.float32  # auto: as dtype
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of"):
        EngineConfig(model_path="m", kv_cache_dtype="int8")
    with pytest.raises(SystemExit):
        build_parser().parse(["--model", "m", "--kv-cache-dtype", "fp4"])


@pytest.mark.parametrize("name", sorted(FP8))
def test_pool_stores_saturate_and_take_half_the_bytes(name: str) -> None:
    dt = FP8[name]
    pool = KVPool(2, 4, 4, 2, 8, dt, CPU, 2, 4)
    assert pool.k[0].dtype == pool.v[1].dtype == dt
    assert 2 * KVPool.bytes_per_page(2, 4, 2, 8, dt) == KVPool.bytes_per_page(2, 4, 2, 8,
                                                                               torch.bfloat16)
    k = torch.randn(3, 2, 8)
    k[0, 0, 0], k[1, 1, 7] = 1e9, -1e9  # past both types' range: a plain cast gives NaN/inf
    v = -k
    pool.store(1, torch.tensor([0, 5, 13]), k, v)
    got_k, got_v = pool.k_flat(1)[[0, 5, 13]].float(), pool.v_flat(1)[[0, 5, 13]].float()
    top = torch.finfo(dt).max
    assert got_k[0, 0, 0] == top and got_k[1, 1, 7] == -top and got_v[0, 0, 0] == -top
    assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()
    inside = k.abs() < 100
    torch.testing.assert_close(got_k[inside], k[inside], rtol=2.0 ** -(dt.itemsize + 2),
                               atol=1e-2)


def _plan(step: int, prompt: list[int], cut: int) -> list[StepPlan]:
    """A 2-chunk prefill (the second chunk reads the first's KV from the cache), then decodes."""
    first = ReqPlan(rid=0, slot=0, cache_len=0, input_ids=prompt[:cut], page_offset=0,
                    new_pages=list(range(-(-cut // 4))), sample=False)
    n = len(prompt)
    second = ReqPlan(rid=0, slot=0, cache_len=cut, input_ids=prompt[cut:],
                     page_offset=len(first.new_pages),
                     new_pages=list(range(len(first.new_pages), -(-n // 4))), sample=True)
    return [StepPlan(step, [first]), StepPlan(step + 1, [second])]


@pytest.mark.parametrize("name,tol", [("fp8_e4m3", 0.1), ("fp8_e5m2", 0.2)])  # measured .06, .13
def test_logits_close_to_a_full_precision_cache(tiny_model, name: str, tol: float) -> None:
    """Prompt tokens 10.. attend to fp8 K/V of tokens 0..9 (the second chunk reads them back from
    the pool): logits differ from the fp32 cache's (the fp8 path is taken) but stay within a few
    percent (a random tiny model; real models lose less), and most greedy tokens agree."""
    path = str(tiny_model("qwen3"))
    prompt = [(7 * i + 3) % VOCAB for i in range(23)]
    logits = {}
    for kv in ("auto", name):
        eng = Engine(EngineConfig(model_path=path, page_size=4, num_pages=16, max_slots=2,
                                  kv_cache_dtype=kv))
        first, second = _plan(0, prompt, 10)
        eng.forward_logits(first)
        logits[kv] = eng.forward_logits(second).float()
        assert eng.pool.k[0].dtype == (FP8[name] if kv != "auto" else torch.float32)
        assert eng.info().kv_cache_dtype == str(eng.pool.k[0].dtype).removeprefix("torch.")
        eng.close()
    ref, got = logits["auto"], logits[name]
    err = ((got - ref).norm() / ref.norm()).item()
    assert 0 < err < tol, err
    # This random tiny model has near-ties; measured: 12/13 (e4m3) and 13/13 (e5m2) agree.
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.75
