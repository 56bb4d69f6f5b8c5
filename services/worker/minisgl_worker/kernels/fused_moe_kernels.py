"""Triton kernels behind `fused_moe`: pair alignment and the two grouped expert GEMMs.

Vocabulary. A *pair* is one (token, k) routing choice; pair p = token * TOPK + k, so the flat
`topk_ids` is indexed by pair. *Alignment* lays the pairs out grouped by expert, each expert's group
padded to a multiple of BLOCK_M with the sentinel `num_pairs`, so that every BLOCK_M-row tile of the
grouped GEMMs belongs to one expert. `expert_of_block[b]` names that expert and `num_padded[0]` is
the used length; launch grids are sized for the worst case (known on the host without a device
sync, which keeps the whole op capturable in a CUDA graph) and surplus tiles exit at once.

Arguments that change with the batch (num_pairs, num_tiles_m) are not specialised, so a new batch
size never triggers a recompile.

Ids outside [0, num_experts) are never placed: memory stays safe, but their pairs contribute
garbage, so callers pass ids from a router (fused_moe validates ids on CPU tensors only).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import begin as _pdl_begin

# --------------------------------------------------------------------------------------------
# Alignment
# --------------------------------------------------------------------------------------------


@triton.jit
def _onehot_chunk(ids_ptr, start, num_pairs, num_experts, E_PAD: tl.constexpr,
                  BLOCK: tl.constexpr):
    """[BLOCK, E_PAD] int32 one-hot of the experts of pairs start..start+BLOCK (0 rows past the end
    or for an invalid id)."""
    offs = start + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    e = tl.where((e >= 0) & (e < num_experts), e, -1)
    return (e[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)


@triton.jit
def _plan_groups(counts, sorted_ptr, expert_of_block_ptr, num_padded_ptr, num_pairs,
                 E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """From per-expert pair counts: write the pad sentinels, each tile's expert and the padded
    length. Returns each expert's first slot (where its pairs go, in any order)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    # Each expert has fewer than BLOCK_M pad slots, at [start + count, end).
    slot = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + slot, num_pairs, mask=slot < ends[:, None])
    # Tile b starts at row b * BLOCK_M; its expert is the number of groups that end at or before.
    for b0 in range(0, total // BLOCK_M, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        owner = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(expert_of_block_ptr + blocks, owner, mask=blocks * BLOCK_M < total)
    return starts


@triton.jit(do_not_specialize=["num_pairs"])
def align_single_kernel(ids_ptr, sorted_ptr, expert_of_block_ptr, num_padded_ptr,
                        num_pairs, num_experts, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    """All of the alignment in one program (one launch: the decode path). Pairs keep their
    original order inside each expert's group, so the layout is deterministic."""
    _pdl_begin(USE_PDL)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        counts += tl.sum(_onehot_chunk(ids_ptr, start, num_pairs, num_experts, E_PAD, BLOCK), 0)
    cursor = _plan_groups(counts, sorted_ptr, expert_of_block_ptr, num_padded_ptr, num_pairs,
                          E_PAD, BLOCK_M, BLOCK_B)
    for start in range(0, num_pairs, BLOCK):
        onehot = _onehot_chunk(ids_ptr, start, num_pairs, num_experts, E_PAD, BLOCK)
        rank = tl.cumsum(onehot, 0) - onehot  # earlier pairs of the same expert in this chunk
        slot = tl.sum(onehot * (cursor[None, :] + rank), 1)
        offs = start + tl.arange(0, BLOCK)
        placed = tl.sum(onehot, 1) > 0
        tl.store(sorted_ptr + slot, offs, mask=placed)
        cursor += tl.sum(onehot, 0)


@triton.jit(do_not_specialize=["num_pairs"])
def count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, E_PAD: tl.constexpr,
                 BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Many-program histogram into a zeroed counts[E_PAD]."""
    _pdl_begin(USE_PDL)
    start = tl.program_id(0) * BLOCK
    onehot = _onehot_chunk(ids_ptr, start, num_pairs, num_experts, E_PAD, BLOCK)
    tl.atomic_add(counts_ptr + tl.arange(0, E_PAD), tl.sum(onehot, 0))


@triton.jit(do_not_specialize=["num_pairs"])
def plan_kernel(counts_ptr, cursor_ptr, sorted_ptr, expert_of_block_ptr, num_padded_ptr,
                num_pairs, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
                USE_PDL: tl.constexpr = False):
    _pdl_begin(USE_PDL)
    experts = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + experts)
    starts = _plan_groups(counts, sorted_ptr, expert_of_block_ptr, num_padded_ptr, num_pairs,
                          E_PAD, BLOCK_M, BLOCK_B)
    tl.store(cursor_ptr + experts, starts)


@triton.jit(do_not_specialize=["num_pairs"])
def place_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, num_experts, BLOCK: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    """Each pair takes the next free slot of its expert. The order inside a group follows the
    atomics, but every output row is computed independently, so results do not depend on it."""
    _pdl_begin(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    ok = (offs < num_pairs) & (e >= 0) & (e < num_experts)
    slot = tl.atomic_add(cursor_ptr + tl.where(ok, e, 0), 1, mask=ok)
    tl.store(sorted_ptr + slot, offs, mask=ok)


# --------------------------------------------------------------------------------------------
# Grouped GEMMs
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(num_tiles_m, num_cols, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (tile_m, tile_n). Consecutive programs take GROUP_M row tiles of one column
    tile (its weights stay in L2), then the next column tile; GROUP_M=1 sweeps a row's columns."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(num_cols, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    return tile_m, tile_n


@triton.jit
def tile_pairs(sorted_ptr, expert_of_block_ptr, tile_m, num_pairs, DIV: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """Row tile tile_m of the expert-aligned pairs (align_pairs): (rows, which are real pairs,
    the source row each reads: pair // DIV (the token for DIV=top_k, the pair itself for 1), and
    the tile's expert). Pad rows read source row 0 (no load masks in the K loop); their results
    are never stored."""
    rows = tl.load(sorted_ptr + tile_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_pairs
    src = tl.where(valid, rows // DIV, 0).to(tl.int64)
    expert = tl.load(expert_of_block_ptr + tile_m).to(tl.int64)
    return rows, valid, src, expert


@triton.jit
def _dot_acc(acc, a, w, SWAP_AB: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a . w, or with SWAP_AB the transposed tile's acc + w . a. An fp8 slice's product is
    added to the fp32 sums on its own (promotion: Hopper's fp8 accumulation alone loses bits)."""
    if SWAP_AB:
        if FP8:
            acc += tl.dot(w, a)
        else:
            acc = tl.dot(w, a, acc, input_precision=PRECISION)
    else:
        if FP8:
            acc += tl.dot(a, w)
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def gate_up_kernel(x_ptr, x_scale_ptr, w_ptr, scale_ptr, out_ptr, sorted_ptr, expert_of_block_ptr,
                   num_padded_ptr, num_pairs, hidden, inter, num_tiles_m,
                   stride_xt, stride_we, stride_wn, stride_se, stride_ot,
                   b_ptr, stride_be, alpha, limit,
                   TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr, FP8: tl.constexpr, SWAP_AB: tl.constexpr = False,
                   USE_PDL: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
                   CLAMPED: tl.constexpr = False):
    """out[pair, n] = silu(x[token] . w_gate[e, n]) * (x[token] . w_up[e, n]) for one tile.

    gpt-oss experts: HAS_BIAS adds b [E, 2*inter] (gate then up, like w) to both sums first;
    CLAMPED takes the clamped SwiGLU (kernels/clamped_swiglu.py) with `alpha`, `limit` instead
    of SiLU-and-mul (unused otherwise).

    w is [E, 2*inter, hidden] with the gate rows first; a program computes BLOCK_N columns of both
    halves so that SiLU-and-mul happens in registers and only the product goes to memory.
    FP8: x and w hold fp8 rows (x_scale [T], scale [E, 2*inter]): each BLOCK_K slice is its own
    fp8 dot added to the fp32 sums (promotion: Hopper's fp8 accumulation alone loses bits), and
    the row scales multiply the sums.
    SWAP_AB computes the transposed tile, w [BLOCK_N, K] . x^T [K, BLOCK_M], so that the weight
    columns fill the tensor-core instruction's M side (Hopper's wgmma needs 64 rows a warpgroup;
    a decode tile has 16-32 pair rows), the same sums in the same order.
    """
    _pdl_begin(USE_PDL)
    tile_m, tile_n = _tile_coords(num_tiles_m, inter, BLOCK_N, GROUP_M)
    if tile_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, valid, token, expert = tile_pairs(sorted_ptr, expert_of_block_ptr, tile_m,
                                            num_pairs, TOPK, BLOCK_M)

    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = (offs_n % inter).to(tl.int64)  # wrap past the edge; those columns are not stored
    w_base = w_ptr + expert * stride_we
    if SWAP_AB:  # a [BLOCK_K, BLOCK_M], g/u [BLOCK_N, BLOCK_K]
        a_ptrs = x_ptr + token[None, :] * stride_xt + offs_k[:, None]
        g_ptrs = w_base + w_rows[:, None] * stride_wn + offs_k[None, :]
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:  # a [BLOCK_M, BLOCK_K], g/u [BLOCK_K, BLOCK_N]
        a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
        g_ptrs = w_base + w_rows[None, :] * stride_wn + offs_k[:, None]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u_ptrs = g_ptrs + inter * stride_wn
    acc_u = tl.zeros_like(acc_g)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < hidden - k0
            k_a = k_ok[:, None] if SWAP_AB else k_ok[None, :]
            k_w = k_ok[None, :] if SWAP_AB else k_ok[:, None]
            a = tl.load(a_ptrs, mask=k_a, other=0.0)
            g = tl.load(g_ptrs, mask=k_w, other=0.0)
            u = tl.load(u_ptrs, mask=k_w, other=0.0)
        acc_g = _dot_acc(acc_g, a, g, SWAP_AB, FP8, PRECISION)
        acc_u = _dot_acc(acc_u, a, u, SWAP_AB, FP8, PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K

    if SWAP_AB:  # back to [BLOCK_M, BLOCK_N] for the epilogue
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if FP8:
        sx = tl.load(x_scale_ptr + token)[:, None]
        s_ptrs = scale_ptr + expert * stride_se + w_rows
        acc_g *= sx * tl.load(s_ptrs)[None, :]
        acc_u *= sx * tl.load(s_ptrs + inter)[None, :]
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * stride_be + w_rows
        acc_g += tl.load(b_ptrs).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + inter).to(tl.float32)[None, :]
    if CLAMPED:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    else:
        act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < inter))


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def down_kernel(a_ptr, a_scale_ptr, w_ptr, scale_ptr, out_ptr, weights_ptr, sorted_ptr,
                expert_of_block_ptr, num_padded_ptr, num_pairs, hidden, inter, num_tiles_m,
                stride_at, stride_we, stride_wn, stride_se, stride_ot, b_ptr, stride_be,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                FP8: tl.constexpr, SWAP_AB: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                HAS_BIAS: tl.constexpr = False):
    """out[pair, n] = weight[pair] * (act[pair] . w_down[e, n] (+ b[e, n] with HAS_BIAS));
    w is [E, hidden, inter], b [E, hidden] (FP8: fp8 act and w rows with a_scale [pairs] and
    scale [E, hidden]; SWAP_AB: the transposed tile; both as in gate_up_kernel).
    """
    _pdl_begin(USE_PDL)
    tile_m, tile_n = _tile_coords(num_tiles_m, hidden, BLOCK_N, GROUP_M)
    if tile_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, valid, safe_rows, expert = tile_pairs(sorted_ptr, expert_of_block_ptr, tile_m,
                                                num_pairs, 1, BLOCK_M)

    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = (offs_n % hidden).to(tl.int64)
    w_base = w_ptr + expert * stride_we
    if SWAP_AB:  # a [BLOCK_K, BLOCK_M], b [BLOCK_N, BLOCK_K]
        a_ptrs = a_ptr + safe_rows[None, :] * stride_at + offs_k[:, None]
        b_ptrs = w_base + w_rows[:, None] * stride_wn + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:  # a [BLOCK_M, BLOCK_K], b [BLOCK_K, BLOCK_N]
        a_ptrs = a_ptr + safe_rows[:, None] * stride_at + offs_k[None, :]
        b_ptrs = w_base + w_rows[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=k_ok[:, None] if SWAP_AB else k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[None, :] if SWAP_AB else k_ok[:, None], other=0.0)
        acc = _dot_acc(acc, a, b, SWAP_AB, FP8, PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if SWAP_AB:
        acc = tl.trans(acc)
    if FP8:
        acc *= tl.load(a_scale_ptr + safe_rows)[:, None]
        acc *= tl.load(scale_ptr + expert * stride_se + w_rows)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + w_rows).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + safe_rows).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < hidden))
