"""The fused attention prologue (q/k RMSNorm + rotary + KV store in one Triton kernel) under the
Triton interpreter: against the unfused Triton kernels it replaces (bit for bit), against the
torch reference path (closely), and through the attention backends and the engine (the layers'
Triton paths forced on, since there is no GPU here)."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.attention.kv_pool import KVPool  # noqa: E402
from minisgl_worker.kernels import (  # noqa: E402
    fused_kernels,
    fused_ops,
    store_kv,  # noqa: E402
)
from minisgl_worker.layers.norm import RMSNorm  # noqa: E402
from minisgl_worker.layers.rotary import RotaryEmbedding  # noqa: E402

for _mod in (fused_kernels, store_kv):  # imported earlier in this process without the interpreter
    if not any(type(v).__name__ == "InterpretedFunction" for v in vars(_mod).values()):
        importlib.reload(_mod)

NUM_PAGES, MAX_POS = 12, 96


class Case:
    """One layer's inputs: q, k, v as strided views of a packed QKV output, norm weights, a KV
    cache full of garbage and the step's slots (some negative: padded rows)."""

    def __init__(self, t: int, hq: int, hk: int, d: int, page_size: int, dtype: torch.dtype,
                 norm: bool, seed: int = 0, cache_dtype: torch.dtype | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.hq, self.hk, self.d, self.dtype = hq, hk, d, dtype
        self.qkv = (2 * torch.randn(t, (hq + 2 * hk) * d, generator=gen)).to(dtype)
        self.rope = RotaryEmbedding(d, MAX_POS, 10000.0)
        self.positions = torch.randint(0, MAX_POS, (t,), generator=gen)
        self.norms = None
        if norm:
            self.norms = (RMSNorm(d, 1e-6), RMSNorm(d, 1e-6))
            for n in self.norms:
                n.weight.data = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
        shape = (NUM_PAGES, page_size, hk, d)
        self.k_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
        slots = torch.randperm(NUM_PAGES * page_size, generator=gen)[:t]
        slots = torch.cat([slots, torch.full((t - len(slots),), -1)])  # more tokens than slots
        self.pad = torch.rand(t, generator=gen) < 0.25
        self.loc = torch.where(self.pad, -1, slots)

    def views(self) -> tuple[torch.Tensor, ...]:
        """Fresh copies of everything a step writes: q, k, v (views of one qkv), caches."""
        qkv = self.qkv.clone()
        t, hq, hk, d = qkv.shape[0], self.hq, self.hk, self.d
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
        v = qkv[:, (hq + hk) * d :].view(t, hk, d)
        return qkv, q, k, v, self.k_cache.clone(), self.v_cache.clone()

    def fused(self) -> tuple[torch.Tensor, ...]:
        qkv, q, k, v, kc, vc = self.views()
        qw, kw = (self.norms[0].weight, self.norms[1].weight) if self.norms else (None, None)
        fused_ops.qk_norm_rope_store_(q, k, v, self.positions, self.rope.cos, self.rope.sin,
                                      kc, vc, self.loc, q_weight=qw, k_weight=kw, eps=1e-6)
        return q, k, qkv, kc, vc

    def unfused_triton(self) -> tuple[torch.Tensor, ...]:
        """What the layer ran before on CUDA: per-head norm kernels, rotary kernel, KV store."""
        qkv, q, k, v, kc, vc = self.views()
        if self.norms:
            q = fused_ops.rmsnorm(q, self.norms[0].weight, 1e-6)
            k = fused_ops.rmsnorm(k, self.norms[1].weight, 1e-6)
        fused_ops.rotary_(q, k, self.positions, self.rope.cos, self.rope.sin)
        store_kv.store_kv(kc, vc, k, v, self.loc)
        return q, k, qkv, kc, vc

    def torch_reference(self) -> tuple[torch.Tensor, ...]:
        """The CPU path: torch RMSNorm (HF's rounding), torch rotary, index_put store."""
        qkv, q, k, v, kc, vc = self.views()
        if self.norms:
            q, k = self.norms[0](q), self.norms[1](k)
        q, k = self.rope(self.positions, q, k)
        live = self.loc >= 0
        kc.view(-1, self.hk, self.d)[self.loc[live]] = k[live].to(kc.dtype)
        vc.view(-1, self.hk, self.d)[self.loc[live]] = v[live].to(vc.dtype)
        return q, k, qkv, kc, vc


SHAPES = [  # (T, Hq, Hk, D): GQA 2, heads not a power of two, MQA
    (7, 4, 2, 64),
    (5, 6, 2, 32),
    (9, 8, 1, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_equals_unfused_kernels_bit_for_bit(shape, page_size, norm, dtype) -> None:
    """The same fp32 arithmetic in the same order (norm rounded to the activation dtype, as the
    unfused path stores it, then rotated in fp32 and rounded once): identical bits."""
    case = Case(*shape, page_size, dtype, norm)
    q, k, qkv, kc, vc = case.fused()
    q0, k0, qkv0, kc0, vc0 = case.unfused_triton()
    assert torch.equal(q, q0) and torch.equal(k, k0)  # k is rotated in place as well
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    # v is read, never written; cache rows of padded tokens and unused slots keep their garbage
    hv = (shape[1] + shape[2]) * shape[3]
    assert torch.equal(qkv[:, hv:], case.qkv[:, hv:])
    written = torch.zeros(NUM_PAGES * page_size, dtype=torch.bool)
    written[case.loc[case.loc >= 0]] = True
    untouched = ~written.view(NUM_PAGES, page_size)
    assert torch.equal(kc[untouched], case.k_cache[untouched])
    assert torch.equal(vc[untouched], case.v_cache[untouched])
    assert not torch.equal(kc, case.k_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False], ids=["qwen3", "llama"])
def test_fused_close_to_torch_reference(norm, dtype) -> None:
    """Not bitwise: the torch path rounds the norm twice (x_normed.to(dtype), then * weight, as
    HF does) and rotates in the activation dtype, the kernels round once; and the interpreter
    casts fp32 -> bf16 by truncation where a GPU rounds to nearest. So fp32 agrees to a few ulp,
    bf16 to about two bf16 ulp. v and its cache rows are copies: exact."""
    case = Case(11, 4, 2, 64, 4, dtype, norm)
    q, k, _, kc, vc = case.fused()
    q0, k0, _, kc0, vc0 = case.torch_reference()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(q, q0, **tol)
    torch.testing.assert_close(k, k0, **tol)
    torch.testing.assert_close(kc, kc0, **tol)
    assert torch.equal(vc, vc0)


@pytest.mark.parametrize("cache", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_fused_equals_unfused_and_saturates(cache, dtype) -> None:
    """An fp8 KV cache: the fused kernel and store_kv write the same bytes, a value past the
    type's range saturates at its largest finite value (a plain cast gives NaN or inf), and the
    cache holds about the torch path's k."""
    case = Case(9, 4, 2, 64, 4, dtype, True, cache_dtype=cache)
    live = int(torch.nonzero(case.loc >= 0)[0])
    case.qkv[live, (4 + 2) * 64 + 5] = -1e6  # a v element far outside fp8's range
    q, k, _, kc, vc = case.fused()
    q0, k0, _, kc0, vc0 = case.unfused_triton()
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert torch.equal(kc.view(torch.uint8), kc0.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc0.view(torch.uint8))
    assert torch.isfinite(kc.float()).all() and torch.isfinite(vc.float()).all()
    loc = int(case.loc[live])
    assert vc.view(-1, 2, 64)[loc, 0, 5].item() == -torch.finfo(cache).max
    _, k_ref, _, _, _ = case.torch_reference()
    written = case.loc >= 0
    got = kc.view(-1, 2, 64)[case.loc[written]].float()
    # Loosely: the interpreter's fp32 -> fp8 cast is not round-to-nearest (some values land one
    # binade low); GPU stores are checked against torch's cast by tests/gpu/test_attention.py.
    want = k_ref[written].float()
    assert ((got - want).norm() / want.norm()).item() < 0.25  # a wrong layout: ~1.4


def test_several_tokens_per_program(monkeypatch) -> None:
    """Few heads per token (prefill-sized grids do this): each program loops over tokens, the
    last one over fewer than the others; the same bits per token as one token per program."""
    monkeypatch.setattr(fused_ops, "_MIN_GRID", 4)  # as for T = 37 * 128 with the real limit
    assert fused_ops._tokens_per_program(37, (2 + 2) * 32) == 8
    assert fused_ops._tokens_per_program(37, 2 * 32) == 8
    case = Case(37, 2, 1, 32, 4, torch.bfloat16, True)
    q, k, _, kc, vc = case.fused()
    monkeypatch.setattr(fused_ops, "_MIN_GRID", 1 << 30)
    assert fused_ops._tokens_per_program(37, (2 + 2) * 32) == 1
    q0, k0, _, kc0, vc0 = case.fused()
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    q1, k1, *_ = case.unfused_triton()
    assert torch.equal(q, q1) and torch.equal(k, k1)


def test_head_norm_several_tokens_per_program(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(32, generator=gen)
    qkv = torch.randn(37, 5 * 32, generator=gen)
    x = qkv[:, 32:96].view(37, 2, 32)
    one = fused_ops.rmsnorm(x, norm.weight, 1e-6)
    monkeypatch.setattr(fused_ops, "_MIN_GRID", 4)
    assert fused_ops._tokens_per_program(37, 2 * 32) == 8
    several = fused_ops.rmsnorm(x, norm.weight, 1e-6)
    assert torch.equal(one, several)
    torch.testing.assert_close(several, norm(x))


def test_kv_pool_store_takes_the_kernel_on_cuda(monkeypatch) -> None:
    """KVPool.store on CUDA tensors (usable() forced on here) writes what index_put writes."""
    pools = [KVPool(2, 6, 4, 2, 16, torch.float32, torch.device("cpu"), 2, 4) for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    loc = torch.tensor([3, 17, 0, 22, 9])
    pools[0].store(1, loc, k, v)
    monkeypatch.setattr(fused_ops, "usable", lambda x: True)
    calls = []
    real = store_kv.store_kv
    monkeypatch.setattr(store_kv, "store_kv", lambda *a: (calls.append(1), real(*a)))
    pools[1].store(1, loc, k, v)
    assert calls
    for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v, strict=True):
        assert torch.equal(a, b)
