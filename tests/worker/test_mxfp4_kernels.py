"""kernels/moe_mxfp4*.py: the grouped MXFP4 expert GEMMs under the Triton interpreter against the
dequantized reference, and the GPU's inline-PTX upcast run instruction by instruction."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.kernels import fused_moe_kernels, moe_mxfp4_kernels, moe_ops  # noqa: E402
from minisgl_worker.kernels.clamped_swiglu import ClampedSwiGLU  # noqa: E402
from minisgl_worker.kernels.fused_moe import GemmTile, MoeConfig  # noqa: E402
from minisgl_worker.kernels.moe_mxfp4 import (  # noqa: E402
    mxfp4_moe_reference,
    mxfp4_moe_triton,
)
from minisgl_worker.quant import mxfp4  # noqa: E402

for _mod, _fn in ((fused_moe_kernels, "align_single_kernel"), (moe_ops, "_sum_over_k_kernel"),
                  (moe_mxfp4_kernels, "gate_up_kernel")):
    if type(getattr(_mod, _fn)).__name__ != "InterpretedFunction":
        importlib.reload(_mod)  # imported earlier in this process without the interpreter


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("swap", [False, True])
def test_kernel_equals_reference(dtype: torch.dtype, swap: bool) -> None:
    """The Triton path (float upcast: the interpreter has no PTX) against the dequantized
    reference: biases, the clamped SwiGLU past its limit, H=96 (a half-masked K step of 64),
    pad rows, several pairs per expert."""
    gen = torch.Generator().manual_seed(0)
    e, h, inter, t, k = 4, 96, 64, 7, 2
    b13, s13 = mxfp4.quantize(torch.randn(e, 2 * inter, h, generator=gen) * 0.2)
    b2, s2 = mxfp4.quantize(torch.randn(e, h, inter, generator=gen) * 0.2)
    w13, w2 = b13.view(e, 2 * inter, h // 2), b2.view(e, h, inter // 2)
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids = torch.randint(0, e, (t, k), generator=gen)
    weights = torch.softmax(torch.randn(t, k, generator=gen), -1).to(dtype)
    act = ClampedSwiGLU(1.702, 0.5)
    b_13 = (0.1 * torch.randn(e, 2 * inter, generator=gen)).to(dtype)
    b_2 = (0.1 * torch.randn(e, h, generator=gen)).to(dtype)
    cfg = MoeConfig(16, GemmTile(32, 64, swap_ab=swap), GemmTile(32, 64, swap_ab=swap))
    got = mxfp4_moe_triton(x, w13, w2, ids, weights, s13, s2, w13_bias=b_13, w2_bias=b_2,
                           activation=act, config=cfg)
    want = mxfp4_moe_reference(x, w13, w2, ids, weights, s13, s2, w13_bias=b_13, w2_bias=b_2,
                               activation=act)
    assert want.abs().max() > 0.3
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # plain SiLU-and-mul: larger values; fp16's reference rounds gate and up to fp16 first
    no_bias = mxfp4_moe_triton(x, w13, w2, ids, weights, s13, s2, config=cfg)
    want = mxfp4_moe_reference(x, w13, w2, ids, weights, s13, s2)
    torch.testing.assert_close(no_bias, want, atol=tol * want.abs().max().item() * 4, rtol=tol)


def _bf16(bits: int) -> float:
    signed = bits - 0x10000 if bits >= 0x8000 else bits
    return torch.tensor([signed], dtype=torch.int16).view(torch.bfloat16).float().item()


def _bits(x: float) -> int:
    return int(torch.tensor([x]).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """The few PTX instructions of the upcast, on Python ints (32-bit registers)."""
    def val(tok: str) -> int:
        return regs[tok] if tok in regs else int(tok, 0)

    for stmt in asm.split(";"):
        stmt = stmt.strip(" \n{}")
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        dst, *src = [a.strip() for a in rest.split(",")]
        v = [val(s) for s in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "prmt.b32":  # byte i of d = byte (selector nibble i) of {b, a}
            pool = v[0] | v[1] << 32
            r = sum(((pool >> (8 * ((v[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i)
                    for i in range(4))
        elif op == "shl.b32":
            r = v[0] << v[1]
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "fma.rn.bf16x2":
            lo, hi = (_bits(_bf16((v[0] >> s) & 0xFFFF) * _bf16((v[1] >> s) & 0xFFFF)
                            + _bf16((v[2] >> s) & 0xFFFF)) for s in (0, 16))
            r = lo | hi << 16
        else:
            raise AssertionError(f"unexpected instruction {op}")
        regs[dst] = r & 0xFFFFFFFF
    return regs


def test_ptx_upcast_decodes_every_byte() -> None:
    """The GPU's inline PTX upcast, run instruction by instruction: every byte value in each
    position of the packed word, scales 2^-127..2^1 (e8m0 0..128): the four bf16x2 outputs are
    the low and high nibbles' e2m1 values times the scale, exactly (and the bf16 factor the
    kernel builds from the scale byte is 2^(s - 1))."""
    values = mxfp4.e2m1_values()
    asm = re.sub(r"\$(\d)", r"r\1", moe_mxfp4_kernels._UPCAST_ASM)
    for s in (0, 1, 100, 120, 127, 128):
        factor = (s + 126) << 7  # the kernel's bits of 2^(s - 1)
        assert _bf16(factor) == 2.0 ** (s - 1)
        for b in range(256):
            word = [b, (b * 7 + 1) % 256, (b * 13 + 5) % 256, (b * 29 + 11) % 256]
            regs = _run_ptx(asm, {"r4": sum(x << (8 * i) for i, x in enumerate(word)),
                                  "r5": factor | factor << 16, "r6": factor | factor << 16})
            for i, byte in enumerate(word):
                for out, nibble in ((i // 2, byte & 15), (2 + i // 2, byte >> 4)):
                    got = _bf16((regs[f"r{out}"] >> (16 * (i % 2))) & 0xFFFF)
                    assert got == values[nibble].item() * 2.0 ** (s - 127), (s, b, i)
