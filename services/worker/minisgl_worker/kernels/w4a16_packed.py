"""Packed 16-bit dequantization for the W4A16 GEMM (w4a16_mma.py with W4Config.packed_dequant):
two weights per 32-bit register, about two instructions a weight instead of four.

The tensor-core operand holds two consecutive K halfwords in one 32-bit register (wgmma's A
fragment, 16-bit types: pairs along K), and consecutive halfwords c, c + 1 of the tile are the
two halves of one packed int32 row. So `tl.inline_asm_elementwise(..., pack=2)` hands the asm
one whole int32 word (8 nibbles); for nibble t of each halfword it emits, per pair:

    shr.b32        w, word, 4t                      (t > 0)
    lop3.b32       v, w, 0x000F000F, MAGIC, 0xEA    (w & mask) | MAGIC: B + q in each half
    fma.rn.bf16x2  v, v, 1.0, -(B + z)              exact: a small integer
    fma.rn.bf16x2  out, v, s, -0.0                  (q - z) * s, one rounding

B is 128 (bf16: 0x4300) or 1024 (fp16: 0x6400), whose last mantissa bit is 1, so OR-ing the
nibble into the mantissa reads as B + q exactly. (B + q) - (B + z) is an integer of at most
4 bits: exact; the product has one rounding, the reference's cast of the fp32 (q - z) * s. Not
one fma v * s - (B + z) * s: (B + z) * s rounded to 16 bits cancels against v * s (B is 8-16x
the difference), leaving only a few good bits. fma rather than sub/mul.bf16x2 (sm_90 only):
sm_80 has it, and ptxas turns both into HADD2/HMUL2/HFMA2 .BF16_V2 anyway. -0.0 keeps the sign
of a zero product, as a multiply would.

Cost (sm_90 SASS of the main loop, tests/worker/sm90_compile.py's cases): 1 LOP3 + 0.75 SHF +
2 HFMA2-class a pair, ~1.9 instructions a weight (2.0 with the zero terms), against ~4.3 for
the plain int16 path (16-bit shifts/masks a halfword, then PRMT and moves to pair them up).

Without ASM (the interpreter, fp32) the same values by Triton arithmetic: the kernel's structure
(one call for the four nibbles, per-nibble scales and negated zero terms) is what the CPU tests
check; the asm text itself is checked by tests/worker/test_w4a16_kernels.py's small PTX
evaluator and on the GPU by tests/gpu/test_w4a16.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


def dequant_asm(magic: int, one: int, ftype: str) -> str:
    """PTX for 4 outputs ($0..$3: nibble t of both halfwords of $4, (q - z) * s as ftype x2),
    scales $5..$8 and negated zero terms -(B + z) $9..$12, one pair each per nibble."""
    lines = ["{", ".reg .b32 w, v, one, nz;", f"mov.b32 one, {one:#010x};",
             "mov.b32 nz, 0x80008000;"]
    for t in range(4):
        src = "$4"
        if t:
            lines.append(f"shr.b32 w, $4, {4 * t};")
            src = "w"
        lines += [f"lop3.b32 v, {src}, 0x000F000F, {magic:#010x}, 0xEA;",
                  f"fma.rn.{ftype}x2 v, v, one, ${9 + t};",
                  f"fma.rn.{ftype}x2 ${t}, v, ${5 + t}, nz;"]
    return "\n".join(lines + ["}"])


DEQUANT_BF16_ASM = dequant_asm(0x43004300, 0x3F803F80, "bf16")
DEQUANT_F16_ASM = dequant_asm(0x64006400, 0x3C003C00, "f16")
# What the kernels read: a jit function may read no globals but constexprs (see
# moe_mxfp4_kernels.py)
_BF16 = tl.constexpr(DEQUANT_BF16_ASM)
_F16 = tl.constexpr(DEQUANT_F16_ASM)


@triton.jit
def _nibble_ref(half, t: tl.constexpr, s, nbz, DT: tl.constexpr):
    """What the asm computes for nibble t, by Triton arithmetic (no conversions)."""
    q = (half >> (4 * t)) & 0xF
    if DT == tl.bfloat16:  # noqa: SIM300
        v = (q | 0x4300).to(tl.bfloat16, bitcast=True)
    elif DT == tl.float16:  # noqa: SIM300
        v = (q | 0x6400).to(tl.float16, bitcast=True)
    else:
        v = (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
    return (v + nbz) * s


@triton.jit
def dequant4(half, s0, s1, s2, s3, z0, z1, z2, z3, DT: tl.constexpr, ASM: tl.constexpr):
    """int16 halfwords [BN, C] -> the four DT weight tiles of nibbles t = 0..3, (q - z) * s;
    s_t the scales and z_t the negated zero terms -(B + z) of nibble t's rows (DT, [BN, C])."""
    if ASM:
        if DT == tl.bfloat16:  # noqa: SIM300
            w0, w1, w2, w3 = tl.inline_asm_elementwise(
                _BF16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [half, s0, s1, s2, s3, z0, z1, z2, z3],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True,
                pack=2)
        else:
            w0, w1, w2, w3 = tl.inline_asm_elementwise(
                _F16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [half, s0, s1, s2, s3, z0, z1, z2, z3],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        w0 = _nibble_ref(half, 0, s0, z0, DT)
        w1 = _nibble_ref(half, 1, s1, z1, DT)
        w2 = _nibble_ref(half, 2, s2, z2, DT)
        w3 = _nibble_ref(half, 3, s3, z3, DT)
    return w0, w1, w2, w3
