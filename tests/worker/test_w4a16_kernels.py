"""The W4A16 kernels under the Triton interpreter (CPU), against quant/w4a16.py's reference
formulas: the dense GEMV and GEMM (kernels/w4a16_gemm.py) and the fused MoE
(kernels/moe_w4a16.py), every variant of the layout on tiny shapes, plus the layout's own round
trips checked against independent packing loops.

bf16 runs only through the GEMV (no tl.dot): the interpreter's bf16 dot is not supported
(see test_fused_moe.py); tests/gpu/test_w4a16.py covers bf16 on the GPU.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (see test_fused_moe.py)

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.kernels import (  # noqa: E402
    fused_moe_kernels,
    moe_ops,
    moe_w4a16_kernels,
    w4a16_gemm,
    w4a16_kernels,
    w4a16_mma,
    w4a16_packed,
)
from minisgl_worker.kernels.fused_moe import GemmTile, MoeConfig, route  # noqa: E402
from minisgl_worker.kernels.moe_w4a16 import (  # noqa: E402
    choose_config,
    fused_moe_w4a16,
    moe_w4a16_reference,
)
from minisgl_worker.kernels.w4a16_gemm import CONFIGS, W4Config, w4a16_linear  # noqa: E402
from minisgl_worker.quant.w4a16 import (  # noqa: E402
    W4Experts,
    W4Weight,
    dequantize,
    dequantize_experts,
    pack_rows,
    quantize,
    quantize_experts,
    reference_linear,
    unpack_rows,
)

for _mod in (w4a16_kernels, moe_w4a16_kernels, fused_moe_kernels, moe_ops):
    if type(getattr(_mod, next(n for n in dir(_mod) if n.endswith("_kernel")))).__name__ \
            != "InterpretedFunction":
        importlib.reload(_mod)  # imported earlier in this process without the interpreter
if type(w4a16_packed.dequant4).__name__ != "InterpretedFunction":
    importlib.reload(w4a16_packed)
    importlib.reload(w4a16_mma)

GEMV = W4Config(True, 1, 16, 64, waves=4)  # split-K: 4 splits of K=256
GEMV4 = W4Config(True, 1, 32, 32, waves=0)  # no split, one K step; 3 rows
GEMM = W4Config(False, 16, 16, 64, waves=4, group_m=2)  # split-K, grouped tile order
GEMM32 = W4Config(False, 32, 32, 128)  # x' reordered by the wrapper (x_permuted)
GATHER = W4Config(False, 16, 32, 64, waves=2, x_permuted=False)  # x's columns gathered in-kernel
# the packed dequantization (w4a16_packed.py; its Triton-arithmetic form here, no PTX)
PACKED = W4Config(False, 16, 16, 64, waves=4, group_m=2, packed_dequant=True)
PACKED32 = W4Config(False, 32, 32, 128, packed_dequant=True)
PACKED_GATHER = W4Config(False, 16, 32, 64, waves=2, x_permuted=False, packed_dequant=True)
PATHS = {"gemv": GEMV, "gemv4": GEMV4, "gemm": GEMM, "gemm32": GEMM32, "gather": GATHER,
         "packed": PACKED, "packed32": PACKED32, "packed_gather": PACKED_GATHER}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def check(x: torch.Tensor, w: W4Weight, cfg: W4Config | None, tol: float = 2e-6) -> None:
    out = w4a16_linear(x, w, cfg)
    ref = reference_linear(x.float(), w)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert rel_err(out, ref) < tol, rel_err(out, ref)


# ---- the layout ---------------------------------------------------------------------------------


def test_pack_rows_nibble_order_and_round_trip() -> None:
    q = torch.randint(0, 16, (64, 5), generator=torch.Generator().manual_seed(1))
    packed = pack_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 5)
    for r in range(8):  # an independent loop: nibble j of row r is q[8r + j]
        for n in range(5):
            word = sum(int(q[8 * r + j, n]) << (4 * j) for j in range(8))
            assert int(packed[r, n]) & 0xFFFFFFFF == word
    assert torch.equal(unpack_rows(packed), q)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 128, -1])
def test_quantize_dequantize_round_trip(group: int, symmetric: bool) -> None:
    w = weights(24, 256)
    q = quantize(w, group, symmetric)
    g = 256 if group == -1 else group
    assert q.scales.shape == (256 // g, 24) and (q.zeros is None) == symmetric
    step = q.scales.float().repeat_interleave(g, 0).t()  # one step a group: error <= step / 2
    assert bool(((dequantize(q) - w).abs() <= step / 2 + 1e-6).all())
    again = quantize(dequantize(q), group, symmetric)  # a grid point re-quantizes to itself
    assert torch.equal(again.qweight, q.qweight)


def test_act_order_perm_dequantizes_to_checkpoint_order() -> None:
    w = weights(16, 64)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(2)).to(torch.int32)
    plain, ordered = quantize(w, 32, perm=None), quantize(w, 32, perm=perm)
    assert rel_err(dequantize(ordered), w) < 0.2 and not torch.equal(plain.qweight, ordered.qweight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(reference_linear(x, ordered), x @ dequantize(ordered).t())


def test_experts_round_trip() -> None:
    w = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(3))
    ex = quantize_experts(w, 32, symmetric=False)
    assert isinstance(ex, W4Experts) and ex.qweight.shape == (3, 8, 16)
    assert ex.scales.shape == ex.zeros.shape == (3, 2, 16)  # type: ignore[union-attr]
    dq = dequantize_experts(ex)
    for e in range(3):
        torch.testing.assert_close(dq[e], dequantize(quantize(w[e], 32, symmetric=False)))


# ---- dense kernels ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_dense_groups_and_zeros(group: int, symmetric: bool, path: str) -> None:
    w = quantize(weights(48, 256, seed=group), group, symmetric)
    cfg = PATHS[path]
    for m in (1, 3 if cfg.gemv else cfg.block_m + 1):  # one row; rows past a tile
        check(torch.randn(m, 256), w, cfg)


@pytest.mark.parametrize("path", PATHS)
def test_ragged_n_and_k(path: str) -> None:
    # N=40 wraps past the last column tile; K=96 is not a multiple of BLOCK_K (masked tails,
    # and a split that ends mid-tile); per-channel groups (G = K) make the group per row.
    for group in (32, -1):
        w = quantize(weights(40, 96, seed=5), group, symmetric=False)
        check(torch.randn(3, 96), w, PATHS[path])


@pytest.mark.parametrize("path", PATHS)
def test_act_order_perm(path: str) -> None:
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(6)).to(torch.int32)
    w = quantize(weights(32, 128, seed=6), 32, symmetric=False, perm=perm)
    check(torch.randn(2, 128), w, PATHS[path])


def test_act_order_perm_many_rows_index_select() -> None:
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(7)).to(torch.int32)
    w = quantize(weights(32, 64, seed=7), 32, perm=perm)
    check(torch.randn(w4a16_gemm.PERM_GATHER_MAX_M + 3, 64), w, GEMM32)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_gidx_rows_of_a_row_parallel_shard(m: int, packed: bool) -> None:
    """Act-order rows of a TP shard: any group per canonical row, fewer rows than groups * G;
    M=1 with the GEMV config must reroute to the GEMM's gather path."""
    g = torch.Generator().manual_seed(8)
    k, n, groups = 96, 24, 5
    w = W4Weight(pack_rows(torch.randint(0, 16, (k, n), generator=g)),
                 torch.rand(groups, n, generator=g) + 0.1,
                 torch.randint(0, 16, (groups, n), generator=g).float(), 32,
                 torch.randperm(k, generator=g).to(torch.int32),
                 torch.randint(0, groups, (k,), generator=g, dtype=torch.int32))
    check(torch.randn(m, k), w, PACKED_GATHER if packed else GEMV if m == 1 else GEMM)


@pytest.mark.parametrize("path", PATHS)
def test_fp16(path: str) -> None:
    w = quantize(weights(32, 128, seed=9).half(), 64, symmetric=False)
    check(torch.randn(3, 128).half(), w, PATHS[path], tol=2e-3)  # fp16 tile and output


def test_bf16_gemv() -> None:
    w = quantize(weights(32, 128, seed=10).bfloat16(), 32)
    check(torch.randn(1, 128).bfloat16(), w, GEMV, tol=1e-2)  # bf16 output rounding


def test_split_k_is_deterministic_and_resets_its_counters() -> None:
    w = quantize(weights(48, 512, seed=11), 128)
    x = torch.randn(1, 512)
    first = w4a16_linear(x, w, GEMV)
    assert w4a16_gemm.split_plan(3, 512, GEMV, x.device)[0] > 1
    assert torch.equal(w4a16_linear(x, w, GEMV), first)
    assert not bool(w4a16_gemm._counters(x.device).any())


@pytest.mark.parametrize("max_rows", [rows for rows, _ in CONFIGS])
def test_default_configs(max_rows: int) -> None:
    m = min(max_rows, 130)
    cfg = w4a16_gemm.config_for(m)
    assert cfg.block_k % 8 == 0 and (cfg.gemv or cfg.block_k >= 32)
    check(torch.randn(m, 256), quantize(weights(64, 256, seed=m), 128), None)


# ---- the packed dequantization's PTX, evaluated on the CPU -------------------------------------


def _halves(r: torch.Tensor, ftype: str) -> torch.Tensor:
    """uint32 words (int64) -> [..., 2] float64: the two 16-bit floats, low half first."""
    h = torch.stack([r & 0xFFFF, r >> 16], -1).to(torch.int16)  # wraps like a bitcast
    return h.view(torch.bfloat16 if ftype == "bf16" else torch.float16).double()


def _fma_x2(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, ftype: str) -> torch.Tensor:
    """fma.rn.{ftype}x2: a * b + c per half with one rounding. Computed in float64; asserted
    exact in float32, so float32 -> 16-bit is that one rounding (no double rounding)."""
    exact = _halves(a, ftype) * _halves(b, ftype) + _halves(c, ftype)
    assert torch.equal(exact.float().double(), exact)
    bits = exact.float().to(torch.bfloat16 if ftype == "bf16" else torch.float16)
    u = bits.view(torch.int16).long() & 0xFFFF
    return u[..., 0] | (u[..., 1] << 16)


def run_ptx(text: str, args: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Evaluates the few PTX instructions dequant_asm emits on int64 tensors of uint32 words."""
    regs = dict(args)

    def val(tok: str) -> torch.Tensor | int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            out = torch.full_like(args["$4"], val(src[0]))
        elif op == "shr.b32":
            out = val(src[0]) >> val(src[1])  # type: ignore[operator]
        elif op == "lop3.b32":
            a, b, c, lut = (val(t) for t in src)
            out = torch.zeros_like(args["$4"])
            for i in range(8):  # the truth table: bit (4a + 2b + c) of lut, as PTX's 0xF0/CC/AA
                if lut >> i & 1:  # type: ignore[operator]
                    ta = a if i & 4 else ~a & 0xFFFFFFFF  # type: ignore[operator]
                    tb = b if i & 2 else ~b & 0xFFFFFFFF  # type: ignore[operator]
                    tc = c if i & 1 else ~c & 0xFFFFFFFF  # type: ignore[operator]
                    out = out | (ta & tb & tc)
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            out = _fma_x2(*(torch.as_tensor(val(t)).expand_as(args["$4"]) for t in src),
                          op.split(".")[2][:-2])
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
        regs[dst] = out & 0xFFFFFFFF
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_dequant_ptx_matches_the_reference_rounding(dtype: torch.dtype) -> None:
    """Every (q, z) pair in both halves of a word, many scales: the asm's (q - z) * s is the
    fp32 product rounded once to the 16-bit type, bit for bit (zeros' signs included)."""
    ftype, base = ("bf16", 128.0) if dtype == torch.bfloat16 else ("f16", 1024.0)
    text = w4a16_packed.DEQUANT_BF16_ASM if ftype == "bf16" else w4a16_packed.DEQUANT_F16_ASM
    g = torch.Generator().manual_seed(13)
    q = torch.randint(0, 16, (4096, 8), generator=g)  # q[:, j]: nibble j of a word
    # a zero and a scale per nibble t and halfword (gidx: rows of one word in other groups)
    z = torch.randint(0, 16, (4, 4096, 2), generator=g).to(dtype)
    s = (torch.randn(4, 4096, 2, generator=g) * torch.logspace(-4, 1, 4096)[:, None]).to(dtype)
    word = sum(q[:, j].long() << (4 * j) for j in range(8))  # halfword h: nibbles 4h .. 4h + 3

    def pair(v: torch.Tensor) -> torch.Tensor:  # [n, 2] 16-bit -> one word, low half first
        u = v.view(torch.int16).long() & 0xFFFF
        return u[:, 0] | (u[:, 1] << 16)

    regs = run_ptx(text, {"$4": word, **{f"${5 + t}": pair(s[t]) for t in range(4)},
                          **{f"${9 + t}": pair(-(z[t].float() + base).to(dtype))
                             for t in range(4)}})
    for t in range(4):
        got = torch.stack([regs[f"${t}"] & 0xFFFF, regs[f"${t}"] >> 16], -1).to(torch.int16)
        qt = torch.stack([q[:, t], q[:, 4 + t]], -1).float()  # nibble t of each halfword
        want = ((qt - z[t].float()) * s[t].float()).to(dtype).view(torch.int16)
        assert torch.equal(got, want), t


# ---- MoE ----------------------------------------------------------------------------------------

E, TOP_K, H, INTER = 8, 2, 64, 32
SMALL = MoeConfig(16, GemmTile(16, 32), GemmTile(32, 64, group_m=2))
RAGGED = MoeConfig(32, GemmTile(16, 64), GemmTile(16, 32))  # K tails: H=64 and I=32 < 64


def moe_case(t: int, group: int, symmetric: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = quantize_experts(torch.randn(E, 2 * INTER, H, generator=g) / H**0.5, group, symmetric)
    w2 = quantize_experts(torch.randn(E, H, INTER, generator=g) / INTER**0.5, group, symmetric)
    weights_, ids = route(torch.randn(t, E, generator=g), TOP_K, norm_topk_prob=True)
    return torch.randn(t, H, generator=g), w13, w2, ids, weights_


@pytest.mark.parametrize("config", [SMALL, RAGGED], ids=["small", "ragged"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, -1])
@pytest.mark.parametrize("t", [1, 33])
def test_moe_matches_reference(t: int, group: int, symmetric: bool, config: MoeConfig) -> None:
    x, w13, w2, ids, w = moe_case(t, group, symmetric, seed=t)
    out = fused_moe_w4a16(x, w13, w2, ids, w, config=config)
    ref = moe_w4a16_reference(x, w13, w2, ids, w)
    assert out.shape == ref.shape and rel_err(out, ref) < 1e-5


def test_moe_fp16_default_configs_and_one_expert() -> None:
    x, w13, w2, ids, w = moe_case(9, 32, False, seed=12)
    ref = moe_w4a16_reference(x, w13, w2, ids, w)
    for t in (9, 100):  # choose_config's decode and batch tiles (BLOCK_K past H: masked)
        assert choose_config(t).gate_up.block_k >= 32
    out = fused_moe_w4a16(x, w13, w2, ids, w)
    assert rel_err(out, ref) < 1e-5
    half = W4Experts(w13.qweight, w13.scales.half(), w13.zeros.half(), 32)  # type: ignore[union-attr]
    half2 = W4Experts(w2.qweight, w2.scales.half(), w2.zeros.half(), 32)  # type: ignore[union-attr]
    out16 = fused_moe_w4a16(x.half(), half, half2, ids, w.half(), config=SMALL)
    assert out16.dtype == torch.float16 and rel_err(out16, ref) < 5e-3
    same = torch.full_like(ids, 3)  # every pair to expert 3: several tiles of one expert
    out = fused_moe_w4a16(x, w13, w2, same, w, config=SMALL)
    assert rel_err(out, moe_w4a16_reference(x, w13, w2, same, w)) < 1e-5
