"""--quantization fp8: fp8 rows with a scale each for the projections (fp8.py).

The arithmetic is checked here on CPU: the torch reference formula, the Triton kernels (row
quantization with and without SiLU-and-mul folded in, the fp8-weight GEMV) under the interpreter
against it, and whole tiny models against their unquantized selves. The GPU path
(torch._scaled_mm) is checked against the same reference by tests/gpu/test_fp8.py."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_core.step import ReqPlan, StepPlan  # noqa: E402
from minisgl_worker import fp8, quantize  # noqa: E402
from minisgl_worker.__main__ import build_parser, config_from_args  # noqa: E402
from minisgl_worker.engine import Engine, EngineConfig  # noqa: E402
from minisgl_worker.kernels import fused_kernels, fused_ops  # noqa: E402
from minisgl_worker.layers import fp8_linear  # noqa: E402
from minisgl_worker.layers.linear import (  # noqa: E402
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from .tiny_models import VOCAB  # noqa: E402

if type(fused_kernels._quant_rows_kernel).__name__ != "InterpretedFunction":
    importlib.reload(fused_kernels)  # imported earlier in this process without the interpreter

GEN = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def test_flag_and_config() -> None:
    cfg = config_from_args(build_parser().parse(["--model", "m", "--quantization", "fp8"]))
    assert cfg.quantization == "fp8"
    assert EngineConfig(model_path="m").quantization == "none"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model_path="m", quantization="int4")
    with pytest.raises(SystemExit):
        build_parser().parse(["--model", "m", "--quantization", "awq"])


def test_gpu_without_bf16_is_refused_at_start_up() -> None:
    """On a GPU a non-bf16 model would fall back to the fp32 reference formula on every call
    (all weights upcast each step): a clear error instead. CPU runs the reference."""
    with pytest.raises(ValueError, match="needs --dtype bfloat16"):
        fp8.check_supported("fp8", torch.device("cuda", 0), torch.float16)
    fp8.check_supported("fp8", torch.device("cpu"), torch.float32)
    fp8.check_supported("none", torch.device("cuda", 0), torch.float16)


def test_quantize_rows_error_bound_and_zero_rows() -> None:
    """e4m3 keeps 3 mantissa bits: each element within half an ulp (2^-4 relative) of the
    original, or half the smallest subnormal (2^-10 of the scale) near zero; the row's largest
    magnitude maps onto 448 exactly."""
    t = _randn(16, 200) * torch.logspace(-3, 2, 16)[:, None]
    t[3] = 0.0
    q, s = fp8.quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (16, 1) and s.dtype == torch.float32
    back = q.float() * s
    assert ((back - t).abs() <= t.abs() * 2.0**-4 + s * 2.0**-10).all()
    assert torch.equal(q.float().abs().amax(-1)[t.abs().amax(-1) > 0],
                       torch.full((15,), 448.0))
    assert torch.equal(back[3], torch.zeros(200)) and torch.isfinite(s).all()


def _unrounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantization before its fp8 cast."""
    s = x.float().abs().amax(-1, keepdim=True).clamp_min(fp8._TINY) / fp8.FP8_MAX
    return (x.float() / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX), s


@pytest.mark.parametrize("rows, k, one_pass_max", [(1, 64, 16384), (5, 300, 16384),
                                                  (3, 2048 + 17, 16384), (3, 2048 + 17, 512)])
def test_quant_kernel_equals_reference(monkeypatch: pytest.MonkeyPatch, rows: int, k: int,
                                       one_pass_max: int) -> None:
    """The Triton row quantization (a row in one block, or two passes over blocks when it is
    longer): the reference's scales and values bit for bit up to the final cast (kept fp32
    here: the interpreter's fp8 cast is not round-to-nearest; GPU bytes are checked by
    tests/gpu/test_fp8.py)."""
    monkeypatch.setattr(fused_ops, "_QUANT_ONE_PASS_MAX", one_pass_max)
    x = _randn(rows, k) * 3
    x[0, 5] = 1e6  # a large outlier: the rest of its row lands in e4m3's subnormals
    q, s = fused_ops.quantize_rows_fp8(x, qdtype=torch.float32)
    q_ref, s_ref = _unrounded(x)
    q8_ref, s8_ref = fp8.quantize_rows(x)
    assert torch.equal(s, s_ref) and torch.equal(s, s8_ref)
    assert torch.equal(q, q_ref)
    assert torch.equal(q_ref.to(torch.float8_e4m3fn).view(torch.uint8), q8_ref.view(torch.uint8))
    q8, s8 = fused_ops.quantize_rows_fp8(x)  # the fp8 store itself: dtype, shape, close
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (rows, k) and torch.equal(s8, s)
    assert ((q8.float() - q8_ref.float()).norm() / q8_ref.float().norm()).item() < 0.25


@pytest.mark.parametrize("one_pass_max", [16384, 32])
def test_quant_kernel_folds_silu_and_mul(monkeypatch: pytest.MonkeyPatch,
                                         one_pass_max: int) -> None:
    monkeypatch.setattr(fused_ops, "_QUANT_ONE_PASS_MAX", one_pass_max)
    gate_up = _randn(4, 2 * 96).half()
    q, s = fused_ops.quantize_rows_fp8(gate_up, silu_mul=True, qdtype=torch.float32)
    q_ref, s_ref = _unrounded(fp8.silu_mul_rows(gate_up))
    # exp() of the kernel and of torch may differ in the last fp32 bit, which the fp16 rounding
    # of silu * up almost always absorbs
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(q, q_ref, rtol=1e-3, atol=1e-3)


def test_linear_reference_is_the_product_of_the_dequantized_operands() -> None:
    x, w, b = _randn(7, 96), _randn(40, 96) * 0.05, _randn(40)
    qw, sw = fp8.quantize_rows(w)
    got = fp8_linear.linear(x, qw, sw, b)
    qx, sx = fp8.quantize_rows(x)
    want = torch.nn.functional.linear(qx.float() * sx, qw.float() * sw, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = torch.nn.functional.linear(x, w, b)
    err = ((got - exact).norm() / exact.norm()).item()
    assert 0 < err < 0.05, err  # fp8 moves it, but little (measured ~0.02)
    assert fp8_linear.linear(x[:0], qw, sw).shape == (0, 40)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_reads_fp8_rows_with_their_scales(silu_mul: bool) -> None:
    """Batch-1 decode of a quantized layer: bf16/fp16 activation, fp8 weights, scale per row."""
    k, n = 96, 24
    x = _randn(1, 2 * k if silu_mul else k).half()
    qw, sw = fp8.quantize_rows(_randn(n, k) * 0.05)
    b = _randn(n).half()
    got = fused_ops.gemv(x, qw, b, silu_mul=silu_mul, config=(8, 32, 4, 2),
                         w_scale=sw.view(-1))
    xin = fp8.silu_mul_rows(x) if silu_mul else x
    want = torch.nn.functional.linear(xin.float(), qw.float() * sw, b.float())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


def test_layers_quantize_and_route_silu_mul() -> None:
    col, row, rep = ColumnParallelLinear(32, [16, 16]), RowParallelLinear(16, 8), \
        ReplicatedLinear(32, 4)
    for m in (col, row, rep):
        m.weight.data.copy_(_randn(*m.weight.shape) * 0.1)
    x = _randn(3, 32)
    gate_up_ref = col(x)
    assert not row.folds_silu_mul(gate_up_ref)  # unquantized on CPU: silu_and_mul runs apart
    assert quantize.quantize_model(torch.nn.ModuleList([col, row, rep]), "fp8") == 2
    assert col.weight.dtype == row.weight.dtype == torch.float8_e4m3fn
    assert rep.weight.dtype == torch.float32 and not hasattr(rep, "weight_scale")  # the router
    assert col.weight_scale is not None and col.weight_scale.shape == (32, 1)
    gate_up = col(x)
    assert row.folds_silu_mul(gate_up)
    torch.testing.assert_close(row(gate_up, silu_mul=True),
                               fp8_linear.linear(fp8.silu_mul_rows(gate_up), row.weight, row.weight_scale))
    assert ((gate_up - gate_up_ref).norm() / gate_up_ref.norm()).item() < 0.05
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize.quantize_model(col, "int8")


def _prefill(prompt: list[int]) -> StepPlan:
    return StepPlan(0, [ReqPlan(rid=0, slot=0, cache_len=0, input_ids=prompt, page_offset=0,
                                new_pages=list(range(-(-len(prompt) // 4))), sample=True)])


@pytest.mark.parametrize("arch, layers_quantized, moe_blocks",
                         [("qwen3", 4, 0), ("qwen2", 4, 0), ("qwen3_moe", 3, 1)])
def test_model_logits_close_to_unquantized(tiny_model, arch: str, layers_quantized: int,
                                           moe_blocks: int) -> None:
    """A whole tiny model: quantized projections and MoE experts (the router stays as it is),
    logits within ~13 % of the unquantized model's, greedy tokens mostly equal. This random tiny
    model (weights of std 0.15) has near-ties and amplifies errors layer to layer; the Qwen3
    shapes on the GPU lose less (tests/gpu/test_fp8.py)."""
    from minisgl_worker.layers.moe import SparseMoeBlock
    from minisgl_worker.layers.norm import Fp8FeedingRMSNorm

    path = str(tiny_model(arch))
    prompt = [(7 * i + 3) % VOCAB for i in range(23)]
    logits = {}
    for quant in ("none", "fp8"):
        eng = Engine(EngineConfig(model_path=path, page_size=4, num_pages=16, max_slots=2,
                                  quantization=quant))
        n = sum(m.weight.dtype == torch.float8_e4m3fn for m in eng.model.modules()
                if isinstance(m, fp8_linear.Fp8Linear))
        assert n == (0 if quant == "none" else 2 * layers_quantized), n
        moe = [m for m in eng.model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(moe) == moe_blocks
        for layer in eng.model.model.layers:  # fp8 rows from the norms: decided at load time
            fed = isinstance(layer.input_layernorm, Fp8FeedingRMSNorm)
            assert fed == (quant == "fp8")
            assert isinstance(layer.post_attention_layernorm, Fp8FeedingRMSNorm) == (
                fed and not isinstance(layer.mlp, SparseMoeBlock))  # a router takes bf16 rows
        for block in moe:
            assert (block.w13.dtype == torch.float8_e4m3fn) == (quant == "fp8")
            assert (block.w2_scale is None) == (quant == "none")
            assert block.gate.weight.dtype == torch.float32  # the router stays
        logits[quant] = eng.forward_logits(_prefill(prompt)).float()
        eng.close()
    ref, got = logits["none"], logits["fp8"]
    err = ((got - ref).norm() / ref.norm()).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    # Measured: 0.125-0.132 and 18/23 greedy tokens equal (qwen3_moe with fp8 experts too);
    # fp8 KV alone: 0.06.
    # A wrong scale or layout gives errors near 1.
    assert 0 < err < 0.2, err
    assert agree >= 0.7, agree


@pytest.mark.parametrize("m, n, k", [(5, 40, 256), (16, 72, 512), (70, 33, 256)])
def test_triton_gemm_equals_reference(m: int, n: int, k: int) -> None:
    """The decode-batch fp8 GEMM (kernels/fp8_gemm.py) under the interpreter: the reference
    formula, with edges of M and N masked (K is whole BLOCK_K slices by contract)."""
    from minisgl_worker.kernels import fp8_gemm

    if type(fp8_gemm._fp8_gemm_kernel).__name__ != "InterpretedFunction":
        importlib.reload(fp8_gemm)
    qa, sa = fp8.quantize_rows(_randn(m, k))
    qb, sb = fp8.quantize_rows(_randn(n, k) * 0.05)
    want = (qa.float() @ qb.float().t()) * sa * sb.view(1, -1)
    for acc_mode in (0, 1):
        config = (16, 32, 128, 4, 2, acc_mode)
        assert fp8_gemm.usable(qa, qb, config) and not fp8_gemm.usable(qa[:, :100], qb, config)
        got = fp8_gemm.fp8_gemm(qa, qb, sa, sb, torch.float32, config)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fp8_gemm.config_for(1) is not None and fp8_gemm.config_for(100_000) is None


@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_with_quantization_fused_equals_the_two_kernels(with_residual: bool) -> None:
    """fused_ops.rmsnorm_quant_fp8 (what a norm feeding an fp8 projection runs) writes the
    bytes and scales of rmsnorm then quantize_rows_fp8, and the same residual sum."""
    x = _randn(6, 96).half() * 2
    w = (_randn(96) * 0.1 + 1).half()
    res = _randn(6, 96).half()
    res_a, res_b = res.clone(), res.clone()
    normed = fused_ops.rmsnorm(x, w, 1e-6, residual=res_a if with_residual else None)
    q_ref, s_ref = fused_ops.quantize_rows_fp8(normed)
    q, s = fused_ops.rmsnorm_quant_fp8(x, w, 1e-6, residual=res_b if with_residual else None)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(res_a, res_b)
    assert with_residual != torch.equal(res_b, res)  # the residual was updated in place
