"""Triton kernels for the elementwise parts of a layer: (residual-add +) RMSNorm, rotary
embedding in place, SiLU-and-mul, and the attention prologue (q/k norm + rotary + KV store);
and the one-row matrix-vector product of a batch-1 decode step (SiLU-and-mul folded in).

In plain torch each of these is 5-15 small kernels; at decode batch sizes a layer is dominated by
them (thousands of tiny launches per step, even inside a CUDA graph). One kernel each instead.
The layers use them for CUDA tensors; the torch code in norm.py / rotary.py / mlp.py stays the
reference and the CPU path (tests call these functions directly under TRITON_INTERPRET=1).
Arithmetic is fp32 inside the kernels, rounded once on store. MINISGL_DISABLE_FUSED_OPS=1 turns
them off (debugging; env.py).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from .. import env
from ..config import kv_saturation

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # e4m3: 448


def usable(x: torch.Tensor) -> bool:
    return x.is_cuda and _HAVE_TRITON and not env.SETTINGS.disable_fused_ops


def _k() -> ModuleType:
    from . import fused_kernels

    return fused_kernels


def _pdl(x: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for programmatic dependent launch (kernels/pdl.py)."""
    from . import pdl

    return pdl.options(x)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


_MIN_GRID = 512  # programs a multi-token grid keeps (decode batches stay one token per program)


def _tokens_per_program(n_tokens: int, tile: int) -> int:
    """Tokens one program handles when a token's tile (`tile` elements) is small: enough work
    per program, while the grid keeps >= _MIN_GRID programs. Results never depend on it (each
    token is the same tile, in a loop), so CUDA-graph and eager runs agree whatever T is."""
    n = min(8, max(1, 2048 // tile), max(1, n_tokens // _MIN_GRID))
    return 1 << (n.bit_length() - 1)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x ([N, D], or [T, H, D] per head, rows may be strided).
    With `residual` ([N, D] contiguous): residual += x in place, and the norm is of the sum."""
    d = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.dim() == 3 and residual is None and _pow2(x.shape[1]) * _pow2(d) <= _HEAD_TILE_MAX:
        _head_rmsnorm(x, weight, eps, out)
        return out
    if x.dim() == 3:
        rows, heads, s0, s1 = x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    else:
        rows, heads, s0, s1 = x.shape[0], 1, x.stride(0), 0
    res = residual if residual is not None else out
    _k()._rmsnorm_kernel[(rows,)](x, res, weight, out, out, s0, s1, res.stride(0), d, heads, d,
                                  eps, HAS_RES=residual is not None, BLOCK=_pow2(d), QUANT=False,
                                  QMAX=_FP8_MAX, num_warps=4 if d <= 2048 else 8, **_pdl(x))
    return out


def rmsnorm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_fp8(rmsnorm(x, weight, eps, residual)) in one kernel, for a norm whose only
    consumer is an fp8 projection: x [N, D] -> (q [N, D] fp8 e4m3, scale [N, 1] fp32)."""
    assert x.dim() == 2 and x.stride(-1) == 1
    n, d = x.shape
    q = torch.empty(n, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=x.device)
    if n:
        res = residual if residual is not None else x
        _k()._rmsnorm_kernel[(n,)](x, res, weight, q, scale, x.stride(0), 0, res.stride(0),
                                   q.stride(0), 1, d, eps, HAS_RES=residual is not None,
                                   BLOCK=_pow2(d), QUANT=True, QMAX=_FP8_MAX,
                                   num_warps=4 if d <= 2048 else 8, **_pdl(x))
    return q, scale


_HEAD_TILE_MAX = 8192  # elements of one token's [heads, head_dim] tile in the per-head kernels


def _head_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """Per-head norm of x [T, H, D] into out (contiguous): all heads of a token per program.
    num_warps is fixed at 4, as in the fused prologue, so both lay the tile out alike."""
    t, h, d = x.shape
    tokens = _tokens_per_program(t, _pow2(h) * _pow2(d))
    _k()._head_rmsnorm_kernel[(-(-t // tokens),)](
        x, weight, out, t, x.stride(0), x.stride(1), d, eps, HEADS=h, TOKENS=tokens,
        BLOCK_H=_pow2(h), BLOCK_D=_pow2(d), num_warps=4)


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (rows may be strided, last dim dense).
    cos/sin: [P, D] fp32 caches with equal halves."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if t == 0:
        return
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.is_contiguous()
    _k()._rope_kernel[(t,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                       k.stride(1), cos.stride(0), HQ=hq, HK=hk, HALF=d // 2,
                       BLOCK_HQ=_pow2(hq), BLOCK_HK=_pow2(hk),
                       BLOCK_D=_pow2(d // 2), num_warps=4)


def qk_norm_rope_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor,
                        q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                        eps: float = 0.0) -> None:
    """A layer's attention prologue in one kernel (instead of q norm, k norm, rotary, KV store).

    q [T, Hq, D], k, v [T, Hk, D]: views of the packed QKV output (rows strided, last dim dense).
    With q_weight/k_weight (Qwen3's per-head norms) q and k are RMS-normed first; both are then
    rotated (cos/sin [P, D] fp32, equal halves). q and k are updated in place; k also goes to
    k_cache and v to v_cache ([pages, page_size, Hk, D]) at flat slots out_loc [T] (page *
    page_size + offset; negative: a padding row, nothing stored). k is written in place too, so
    whoever reads k after (a backend's forward) sees what the cache holds.
    Same arithmetic as rmsnorm + rotary_ + store_kv on the same tensors: bit for bit under the
    Triton interpreter (tests), and on a GPU when the compiler lays out the norm tile alike in
    both (fixed 4 warps, same tile per token; bench/micro/fused_ops.py checks it).
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    if t == 0:
        return
    assert d % 2 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert cos.is_contiguous() and sin.is_contiguous() and k_cache.stride(-1) == 1
    assert k_cache.shape[1:] == v_cache.shape[1:] == (k_cache.shape[1], hk, d)
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None)
    qw = q_weight if q_weight is not None else cos  # unread without norms
    kw = k_weight if k_weight is not None else cos
    tokens = _tokens_per_program(t, (_pow2(hq) + 2 * _pow2(hk)) * _pow2(d))
    _k()._qk_norm_rope_store_kernel[(-(-t // tokens),)](
        q, k, v, positions, cos, sin, qw, kw, k_cache, v_cache, out_loc, t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), d, eps,
        HQ=hq, HK=hk, HALF=d // 2, PAGE_SIZE=k_cache.shape[1], HAS_NORM=has_norm,
        TOKENS=tokens, BLOCK_HQ=_pow2(hq), BLOCK_HK=_pow2(hk), BLOCK_D=_pow2(d),
        BLOCK_HALF=_pow2(d // 2), CACHE_MAX=kv_saturation(k_cache.dtype), num_warps=4,
        **_pdl(q))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block = min(1024, _pow2(n))
    _k()._silu_mul_kernel[(x.shape[0], -(-n // block))](x, out, x.stride(0), out.stride(0), n,
                                                          BLOCK=block, num_warps=4, **_pdl(x))
    return out


def embedding_shard(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """ids [N] -> [N, D]: weight[id - start] for the ids this rank's vocabulary block holds
    (rows start .. start + len(weight) - 1), zeros for the others (the TP embedding sums the
    ranks' rows)."""
    n, d = ids.shape[0], weight.shape[1]
    out = torch.empty(n, d, dtype=weight.dtype, device=weight.device)
    if n == 0:
        return out
    block = _pow2(d)
    _k()._embedding_shard_kernel[(n,)](ids, weight, out, start, weight.shape[0], d,
                                       weight.stride(0), out.stride(0), BLOCK=block,
                                       num_warps=4 if block <= 2048 else 8, **_pdl(weight))
    return out


# Launch shape of the one-row product, from a sweep on an H100 (bench/micro/gemv.py --sweep,
# Qwen3-8B shapes): two rows of w per 4-warp program and 1,024 columns a loop step, more
# pipeline stages for the long (down_proj) and the many-row (LM head, gate_up) products.
_GEMV_BLOCK_N, _GEMV_BLOCK_K, _GEMV_WARPS = 2, 1024, 4


def gemv_usable(x: torch.Tensor) -> bool:
    """A one-row product worth our kernel: cuBLAS picks split-K GEMM kernels for M = 1 that
    read the weights at 2.1-2.8 TB/s, where a plain row-per-lane GEMV streams them at 2.5-3.2
    (bs=1 decode reads every weight once a token, so this is its speed). Two rows and up stay
    with cuBLAS, which serves them at the same cost as one."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and usable(x)
            and x.dtype in (torch.bfloat16, torch.float16))


def gemv_group_config(k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMV with per-group weight scales
    (block-quantized fp8 checkpoints), from an H200 sweep on Qwen3-8B shapes
    (bench/micro/fp8_block.py): 3.1-3.8 TB/s, 1.8-2.2x faster than bf16."""
    return (8, 1024, 8, 4) if k >= 8192 else (8, 1024, 4, 2)


def gemv_config(n_rows: int, k: int, silu_mul: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for w [n_rows, k]. With SiLU-and-mul folded in
    every program recomputes the activation of its K columns: fewer, wider programs (4 rows,
    2 warps) keep that work small."""
    if silu_mul:
        return 4, min(_GEMV_BLOCK_K, _pow2(k)), 2, 2
    stages = 4 if k >= 8192 or n_rows >= 65536 else 3 if n_rows >= 16384 else 2
    return _GEMV_BLOCK_N, min(_GEMV_BLOCK_K, _pow2(k)), _GEMV_WARPS, stages


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `gemv` for a single CUDA row."""
    if gemv_usable(x):
        return gemv(x, w, bias)
    return torch.nn.functional.linear(x, w, bias)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         silu_mul: bool = False, config: tuple[int, int, int, int] | None = None,
         w_scale: torch.Tensor | None = None, scale_group: int = 0) -> torch.Tensor:
    """x [1, K] (or [1, 2K] with silu_mul: the [gate | up] row) @ w[N, K].T (+ bias) -> [1, N]
    in x's dtype. w rows may be strided (last dim dense). With w_scale ([N] fp32), w is fp8 and
    row n is w[n] * w_scale[n] (fp8.py); with scale_group g > 0, w_scale is [N, K/g] and each
    g-wide K group of a row has its own scale (block-quantized checkpoints, fp8_block.py)."""
    n_rows, k = w.shape
    assert x.shape == (1, 2 * k if silu_mul else k) and w.stride(-1) == 1, (x.shape, w.shape)
    out = torch.empty(1, n_rows, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or (
        gemv_group_config(k) if scale_group else gemv_config(n_rows, k, silu_mul))
    assert not scale_group or block_k % scale_group == 0, "whole weight scale groups a K step"
    b = bias if bias is not None else out
    s = w_scale if w_scale is not None else out
    _k()._gemv_kernel[(-(-n_rows // block_n),)](
        x, w, s, b, out, n_rows, k, w.stride(0), HAS_BIAS=bias is not None,
        HAS_SCALE=w_scale is not None, SILU_MUL=silu_mul, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
        stride_s=s.stride(0) if scale_group else 0, SCALE_GROUP=scale_group, **_pdl(x))
    return out


_QUANT_ONE_PASS_MAX = 16384


def quantize_rows_fp8(x: torch.Tensor, silu_mul: bool = False,
                      qdtype: torch.dtype = torch.float8_e4m3fn
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (or [M, 2K] [gate | up] rows with silu_mul) -> (q [M, K] fp8, scale [M, 1] fp32)
    with x ~ q * scale per row; the same arithmetic as fp8.quantize_rows (fp8.py).
    qdtype=float32 keeps q unrounded (e4m3's range still applies): tests check the arithmetic
    that way, as the Triton interpreter's fp32 -> fp8 cast is not round-to-nearest."""
    m, k = x.shape[0], x.shape[1] // 2 if silu_mul else x.shape[1]
    assert x.stride(-1) == 1
    q = torch.empty(m, k, dtype=qdtype, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:  # rows up to 16k elements in one block (one read), 32 per thread at most
        block = min(_QUANT_ONE_PASS_MAX, _pow2(k))
        _k()._quant_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                      QMAX=_FP8_MAX,
                                      SILU_MUL=silu_mul, BLOCK=block, ONE_PASS=block >= k,
                                      num_warps=max(4, min(16, block // 1024)), **_pdl(x))
    return q, scale
