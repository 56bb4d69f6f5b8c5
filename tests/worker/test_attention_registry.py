"""Attention backends by name: clear start-up errors, never a silent fallback; hybrid routing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from minisgl_worker import env
from minisgl_worker.attention import (
    BackendUnavailable,
    HybridBackend,
    auto_decode_name,
    auto_prefill_name,
    backend_class,
    create_backend,
    describe,
)
from minisgl_worker.attention.base import AttentionConfig, ForwardBatch
from minisgl_worker.attention.kv_pool import KVPool
from minisgl_worker.attention.torch_backend import TorchBackend
from minisgl_worker.engine import Engine, EngineConfig

from .driver import run_requests
from .test_engine import PROMPTS

CPU = torch.device("cpu")


def _config() -> AttentionConfig:
    return AttentionConfig(4, 2, 16, 0.25, 4, 2, 8, 32, torch.float32, CPU)


def _pool() -> KVPool:
    return KVPool(1, 8, 4, 2, 16, torch.float32, CPU, 2, 8)


@pytest.mark.parametrize("name", ["flashinfer", "fa3", "trtllm"])
def test_gpu_backends_refused_on_cpu(name: str) -> None:
    with pytest.raises(BackendUnavailable, match=f"{name}.*CUDA"):
        create_backend(name, _config(), _pool())


def test_triton_needs_cuda_unless_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(env, "SETTINGS", replace(env.SETTINGS, triton_interpret=False))
    with pytest.raises(BackendUnavailable, match="CUDA"):
        backend_class("triton", CPU)


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'fast'.*flashinfer"):
        create_backend("fast", _config(), _pool())


def test_auto_is_torch_on_cpu() -> None:
    assert describe(create_backend("auto", _config(), _pool())) == "torch"


def test_engine_fails_at_start_up(tiny_model) -> None:  # noqa: ANN001
    for kw in ({"attention_backend": "flashinfer"}, {"decode_attention_backend": "fa3"}):
        with pytest.raises(BackendUnavailable, match="CUDA"):
            Engine(EngineConfig(model_path=str(tiny_model("qwen3")), num_pages=8, **kw))


class _Counting(TorchBackend):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.steps: list[bool] = []

    def prepare(self, batch: ForwardBatch) -> None:
        self.steps.append(batch.is_decode)
        super().prepare(batch)


def test_hybrid_routes_prefill_and_decode(tiny_model) -> None:  # noqa: ANN001
    engine = Engine(EngineConfig(model_path=str(tiny_model("qwen3")), page_size=4,
                                 num_pages=64, max_slots=4))
    expected = run_requests(engine, PROMPTS, 5, 4)
    prefill, decode = _Counting(engine.backend.config, engine.pool), _Counting(
        engine.backend.config, engine.pool)
    engine.backend = HybridBackend(prefill, decode)
    assert run_requests(engine, PROMPTS, 5, 4, chunk=6) == expected
    assert prefill.steps and not any(prefill.steps)
    assert decode.steps and all(decode.steps)
    engine.close()


def test_auto_decodes_with_triton_where_flashinfer_was_picked() -> None:
    fp8 = AttentionConfig(4, 2, 16, 0.25, 4, 2, 8, 32, torch.bfloat16, CPU,
                          kv_dtype=torch.float8_e4m3fn)
    assert auto_decode_name("flashinfer") == "triton"
    assert auto_decode_name("triton") == "triton"  # no FlashInfer installed
    assert auto_decode_name("torch") == "torch"  # CPU: the reference backend throughout
    pool = KVPool(1, 8, 4, 2, 16, torch.float8_e4m3fn, CPU, 2, 8)
    assert describe(create_backend("auto", fp8, pool)) == "torch"


def test_auto_prefills_with_fa3_on_hopper_where_flashinfer_was_picked() -> None:
    """The pick itself (FA3's kernels need an sm_90 GPU to run; tests/gpu checks them)."""
    gpu = torch.device("cuda", 0)
    bf16 = AttentionConfig(32, 8, 128, 128 ** -0.5, 64, 8, 8, 512, torch.bfloat16, gpu)
    hopper, ampere, blackwell = (9, 0), (8, 0), (10, 0)
    assert auto_prefill_name("flashinfer", bf16, hopper) == "fa3"
    assert auto_prefill_name("flashinfer", bf16, ampere) == "flashinfer"
    assert auto_prefill_name("flashinfer", bf16, blackwell) == "flashinfer"
    assert auto_prefill_name("triton", bf16, hopper) == "triton"  # no FlashInfer installed
    fp8 = replace(bf16, kv_dtype=torch.float8_e4m3fn)  # FA3 wants q in fp8 too
    assert auto_prefill_name("flashinfer", fp8, hopper) == "flashinfer"
    odd_head = replace(bf16, head_dim=96)
    assert auto_prefill_name("flashinfer", odd_head, hopper) == "flashinfer"
    fp32 = replace(bf16, dtype=torch.float32)
    assert auto_prefill_name("flashinfer", fp32, hopper) == "flashinfer"
    assert auto_prefill_name("torch", _config()) == "torch"  # CPU: never asks the device
