"""The Triton MoE kernels under the Triton interpreter (CPU), against the torch reference and HF.

bf16 stays out: the interpreter keeps bf16 as raw uint16 bits and its tl.dot multiplies those
(triton-lang/triton#11584, "not supported yet"); tests/gpu/test_moe.py checks bf16 on the GPU.
"""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.kernels import fused_moe_kernels  # noqa: E402
from minisgl_worker.kernels.fused_moe import (  # noqa: E402
    SINGLE_ALIGN_MAX_PAIRS,
    GemmTile,
    MoeConfig,
    align_pairs,
    choose_config,
    fused_moe,
    fused_moe_triton,
    moe_reference,
    quantize_experts,
    route,
    warm_token_counts,
    warm_up,
)

if type(fused_moe_kernels.gate_up_kernel).__name__ != "InterpretedFunction":
    importlib.reload(fused_moe_kernels)  # imported earlier in this process without the interpreter

E, K, H, INTER = 8, 2, 64, 32
SMALL = MoeConfig(16, GemmTile(16, 32), GemmTile(32, 32))
# Many-program alignment, GROUP_M > 1 and K-loops with a ragged tail (H=40, I=24 below).
WIDE = MoeConfig(32, GemmTile(32, 16, group_m=2), GemmTile(16, 16, group_m=3))
# The transposed tiles (weights on the MMA's M side), with the same ragged shapes.
SWAPPED = MoeConfig(16, GemmTile(32, 16, swap_ab=True), GemmTile(16, 16, group_m=2, swap_ab=True))
PATHS = {"single": 10**9, "multi": 0}  # single_align_max_pairs: one program, or four launches


def make(t: int, e: int = E, k: int = K, h: int = H, i: int = INTER, seed: int = 0,
         ids: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    weights, topk = route(torch.randn(t, e, generator=g), k, norm_topk_prob=True)
    return x, w13, w2, (topk if ids is None else ids), weights


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(args, config: MoeConfig = SMALL, path: str = "single", tol: float = 1e-4) -> None:
    out = fused_moe_triton(*args, config=config, single_align_max_pairs=PATHS[path])
    ref = moe_reference(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < tol, rel_err(out, ref)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t", [1, 5, 33])
def test_random_routing_matches_reference(t: int, path: str) -> None:
    check(make(t, seed=t), path=path)


@pytest.mark.parametrize("path", PATHS)
def test_experts_without_tokens(path: str) -> None:
    # Only experts 2 and 6 are used: the other six groups are empty and must get no tiles.
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.full((9,), 2), torch.full((9,), 6)], 1)
    ids[torch.rand(9, generator=g) < 0.5] = torch.tensor([6, 2])
    check(make(9, ids=ids), path=path)


@pytest.mark.parametrize("path", PATHS)
def test_all_pairs_to_one_expert(path: str) -> None:
    # 66 pairs of expert 5 span five 16-row tiles; repeated ids within a token add up.
    check(make(33, ids=torch.full((33, K), 5)), path=path)


@pytest.mark.parametrize("config", [WIDE, SWAPPED], ids=["wide", "swapped"])
@pytest.mark.parametrize("path", PATHS)
def test_ragged_shapes_and_grouped_tiles(path: str, config: MoeConfig) -> None:
    # H and I not multiples of the tiles: masked K tails and wrapped columns; E=5 pads to 8.
    check(make(21, e=5, k=3, h=40, i=24, seed=3), config=config, path=path)


@pytest.mark.parametrize("config", [SMALL, WIDE, SWAPPED], ids=["small", "wide", "swapped"])
def test_gpt_oss_biases_and_clamped_swiglu_match_reference(config: MoeConfig) -> None:
    """gpt-oss experts: biases on both GEMMs and the clamped SwiGLU, with gate/up values well
    past the limit (the reference is checked against HF in test_gpt_oss.py)."""
    from minisgl_worker.kernels.clamped_swiglu import ClampedSwiGLU

    x, w13, w2, ids, w = make(21, e=5, k=3, h=40, i=24, seed=4)
    g = torch.Generator().manual_seed(5)
    extras = dict(w13_bias=torch.randn(5, 48, generator=g), w2_bias=torch.randn(5, 40, generator=g),
                  activation=ClampedSwiGLU(1.702, 1.0))
    out = fused_moe_triton(x, 3 * w13, w2, ids, w, config=config, **extras)
    ref = moe_reference(x, 3 * w13, w2, ids, w, **extras)
    assert rel_err(out, ref) < 1e-4
    plain = moe_reference(x, 3 * w13, w2, ids, w)
    assert rel_err(plain, ref) > 0.1


def test_default_config_and_fp16() -> None:
    x, w13, w2, ids, w = make(4, seed=7)
    check((x, w13, w2, ids, w), config=None)  # choose_config's decode tiles
    half = (x.half(), w13.half(), w2.half(), ids, w.half())
    out = fused_moe_triton(*half, config=SMALL)
    assert out.dtype == torch.float16
    assert rel_err(out, moe_reference(x, w13, w2, ids, w)) < 5e-3


@pytest.mark.parametrize("path", PATHS)
def test_alignment_invariants(path: str) -> None:
    ids = make(33, seed=11)[3]
    num_pairs, bm = ids.numel(), 16
    al = align_pairs(ids, E, bm, single_max_pairs=PATHS[path])
    total = int(al.num_padded)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert total == int(((counts + bm - 1) // bm * bm).sum())
    used = al.sorted_pairs[:total].long()
    real = used[used < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert bool((used[used >= num_pairs] == num_pairs).all())  # pads carry the sentinel
    flat = ids.flatten()
    for b in range(total // bm):
        tile = used[b * bm:(b + 1) * bm]
        tile = tile[tile < num_pairs]
        assert len(tile) > 0 and bool((flat[tile] == al.expert_of_block[b]).all())
    if path == "single":  # one program keeps each group in pair order
        assert real.tolist() == sorted(real.tolist(), key=lambda p: (int(flat[p]), p))


def test_cpu_dispatch_and_bad_input() -> None:
    x, w13, w2, ids, w = make(3)
    assert torch.equal(fused_moe(x, w13, w2, ids, w), moe_reference(x, w13, w2, ids, w))
    assert fused_moe_triton(x[:0], w13, w2, ids[:0], w[:0]).shape == (0, H)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 8\)"):
        fused_moe_triton(x, w13, w2, ids.masked_fill(ids == ids[0, 0], E), w)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_moe(x, w13, w2[:, :, :-1], ids, w)
    with pytest.raises(ValueError, match=r"must both be \[T=3, K\]"):
        fused_moe(x, w13, w2, ids[:2], w[:2])
    with pytest.raises(TypeError, match="integer"):
        fused_moe(x, w13, w2, ids.float(), w)
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(3, E), E + 1, True)


@pytest.mark.parametrize("norm", [True, False])
def test_matches_hf_qwen3_moe_block(norm: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E,
                         num_experts_per_tok=K, norm_topk_prob=norm, hidden_act="silu")
    torch.manual_seed(5)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        x = torch.randn(2, 7, H)
        want = block(x).reshape(-1, H)
        flat = x.reshape(-1, H)
        _, hf_weights, hf_ids = block.gate(flat)
        weights, ids = route(flat @ block.gate.weight.T, K, norm)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
        w13, w2 = block.experts.gate_up_proj, block.experts.down_proj
        assert rel_err(moe_reference(flat, w13, w2, ids, weights), want) < 1e-5
        out = fused_moe_triton(flat, w13, w2, ids, weights, config=SMALL)
        assert rel_err(out, want) < 1e-4


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("t, config", [(5, SMALL), (33, None), (21, WIDE), (21, SWAPPED)])
def test_fp8_experts_match_their_reference(t: int, config: MoeConfig | None, path: str) -> None:
    """fp8 experts: the kernels (fp8 dots of row-quantized inputs and weights, promoted to fp32
    every BLOCK_K slice, scaled) are the reference's fp8 formula up to summation order; against
    the unquantized experts the error is fp8 rounding (3 mantissa bits, a few % of the norm)."""
    # WIDE/SWAPPED: H=40, I=24, E=5, k=3 (masked K tails, wrapped columns, grouped tiles)
    shape = dict(e=5, k=3, h=40, i=24) if config in (WIDE, SWAPPED) else {}
    x, w13, w2, ids, w = make(t, seed=20 + t, **shape)
    q13, s13 = quantize_experts(w13)
    q2, s2 = quantize_experts(w2)
    assert q13.dtype == q2.dtype == torch.float8_e4m3fn and s13.shape == w13.shape[:2]
    scales = dict(w13_scale=s13, w2_scale=s2)
    out = fused_moe_triton(x, q13, q2, ids, w, config=config,
                           single_align_max_pairs=PATHS[path], **scales)
    ref = moe_reference(x, q13, q2, ids, w, **scales)
    assert rel_err(out, ref) < 1e-5, rel_err(out, ref)
    assert torch.equal(fused_moe(x, q13, q2, ids, w, **scales), ref)  # the CPU serving path
    err = rel_err(out, moe_reference(x, w13, w2, ids, w))
    assert 1e-3 < err < 0.1, err  # quantized for real, and not broken (a wrong scale: ~1)


def test_fp8_experts_bad_input() -> None:
    x, w13, w2, ids, w = make(3)
    q13, s13 = quantize_experts(w13)
    q2, s2 = quantize_experts(w2)
    with pytest.raises(TypeError, match="fp8 experts need"):
        fused_moe(x, q13, q2, ids, w)  # scales missing
    with pytest.raises(TypeError, match="fp8 experts need"):
        fused_moe(x, w13, q2, ids, w, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="w2_scale must be fp32"):
        fused_moe_triton(x, q13, q2, ids, w, w13_scale=s13, w2_scale=s2[:, :-1])
    with pytest.raises(ValueError, match="w13_scale must be fp32"):
        fused_moe(x, q13, q2, ids, w, w13_scale=s13.double(), w2_scale=s2)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_warm_up_meets_every_config(top_k: int, fp8: bool) -> None:
    """Start-up runs one token count per (tile config, alignment path): every count a step can
    bring, up to past the last bucket, launches a variant the warm-up already compiled."""
    counts = warm_token_counts(top_k, fp8)
    key = lambda n: (choose_config(n, fp8=fp8), n * top_k <= SINGLE_ALIGN_MAX_PAIRS)  # noqa: E731
    warmed = {key(n) for n in counts}
    assert len(warmed) == len(counts) >= 4  # one count each, and the buckets are many
    missed = [n for n in range(1, 20_000) if key(n) not in warmed]
    assert not missed, missed[:5]


def test_warm_up_compiles_nothing_on_cpu() -> None:
    """CPU tensors serve from the torch reference: no Triton variant to compile."""
    _, w13, w2, _, _ = make(1)
    assert warm_up(w13, w2, K, torch.float32) == []
