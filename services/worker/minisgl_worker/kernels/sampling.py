"""Fused Gumbel-max draw: hash noise + argmax in one pass over the logits.

Bit-for-bit the hash of `sampling.ops` (which is the reference), in uint32 lanes. Each program
scans one chunk of one row and leaves its best (value, index); a tiny torch reduce picks the chunk.
Ties resolve to the lowest index everywhere, like torch.argmax.

With per-row temperatures the kernel also does what used to be two full fp32 passes before it:
it reads the logits in the model's dtype (bf16/fp16, upcast exactly as `.float()` does) and
divides by the temperature itself, with IEEE round-to-nearest division like torch's `x / t` (a
plain `/` in Triton is an approximate division on NVIDIA GPUs, which would change some draws).
Rows with temperature <= 0 are greedy: plain argmax of the upcast logits, no noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_TARGET_PROGRAMS = 512  # enough chunks to spread a small batch over every SM
# The chunk winners' block: one width for every batch size (the chunk count falls as the batch
# grows), so one compiled variant covers vocabularies up to 64 chunks (262,144 tokens at _BLOCK).
_MIN_BLOCK_C = 64


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, position):
    """`sampling.ops.row_keys` for one row (seed < 2**63 and position >= 0, int64)."""
    k = _hash32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9)
    k = _hash32(k ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    return _hash32(k ^ (position & 0xFFFFFFFF).to(tl.uint32))


# Arguments that change with the batch size are not specialised (`do_not_specialize`): Triton
# compiles a variant per value class of an int argument (1, a multiple of 16, other), and the
# first step of a batch size class the warm-up had not met stalled the host while it compiled
# (docs/benchmarks/log/2026-11-26-compiles.md). The chunk loops read whole
# blocks either way; only tiny scalar index maths lose the hint.
@triton.jit(do_not_specialize=["num_chunks"])
def _gumbel_argmax_kernel(x_ptr, seeds_ptr, positions_ptr, temps_ptr, tok_hash_ptr, part_val_ptr,
                          part_idx_ptr, vocab, id_offset, stride_x, stride_seed, stride_temp,
                          chunk, num_chunks, HAS_TEMP: tl.constexpr, TOK_TABLE: tl.constexpr,
                          BLOCK: tl.constexpr, GREEDY: tl.constexpr = False):
    """GREEDY: every row's plain argmax (no noise, seeds and positions unread)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    if GREEDY:
        key = tl.zeros([], tl.uint32)
    else:
        key = _row_key(tl.load(seeds_ptr + row * stride_seed).to(tl.int64),
                       tl.load(positions_ptr + row).to(tl.int64))
    if HAS_TEMP:
        temp = tl.load(temps_ptr + row * stride_temp).to(tl.float32)
        greedy = temp <= 0
        temp = tl.where(greedy, 1.0, temp)  # unused on greedy rows, but no 0 / 0 there
    start = c * chunk
    end = tl.minimum(start + chunk, vocab)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    offs = tl.arange(0, BLOCK)
    for off in range(start, end, BLOCK):
        j = off + offs
        mask = j < end
        raw = tl.load(x_ptr + row.to(tl.int64) * stride_x + j, mask=mask, other=float("-inf"))
        x = raw.to(tl.float32)
        gid = id_offset + j  # the global token id: x may be one TP rank's vocabulary shard
        if GREEDY:
            s = x
        else:
            if HAS_TEMP:
                x = tl.math.div_rn(x, temp)
            if TOK_TABLE:  # the same bits from an L2-resident table: fewer integer ops
                tok = tl.load(tok_hash_ptr + gid, mask=mask, other=0).to(tl.uint32, bitcast=True)
            else:
                tok = _hash32(gid.to(tl.uint32) ^ 0x85EBCA6B)
            bits = _hash32(key ^ tok)
            u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23: u < 1
            # Exactly the expression of the fp32-only kernel: anything between the log and the
            # subtraction could change whether the compiler contracts them into an FMA, and so
            # the last bit of the score.
            s = x - tl.log(-tl.log(u))
            if HAS_TEMP:
                s = tl.where(greedy, raw.to(tl.float32), s)
        s = tl.where(mask, s, float("-inf"))
        better = s > best_val  # strict: a lane keeps its earliest maximum
        best_val = tl.where(better, s, best_val)
        best_idx = tl.where(better, gid, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    tl.store(part_val_ptr + row * num_chunks + c, top)
    tl.store(part_idx_ptr + row * num_chunks + c, idx.to(tl.int64))


@triton.jit(do_not_specialize=["num_chunks"])
def _best_chunk_kernel(part_val_ptr, part_idx_ptr, val_ptr, idx_ptr, num_chunks,
                       BLOCK_C: tl.constexpr):
    """A row's winner over its chunks: the highest score, ties to the earliest chunk (chunks
    are in id order and each holds its lowest best id), as argmax + gather over [B, C] give."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    m = c < num_chunks
    val = tl.load(part_val_ptr + row * num_chunks + c, mask=m, other=float("-inf"))
    first = tl.min(tl.where((val == tl.max(val, axis=0)) & m, c, BLOCK_C), axis=0)
    tl.store(val_ptr + row, tl.load(part_val_ptr + row * num_chunks + first))
    tl.store(idx_ptr + row, tl.load(part_idx_ptr + row * num_chunks + first))


@triton.jit(do_not_specialize=["batch", "rank"])
def _pack_slot_kernel(val_ptr, idx_ptr, buf_ptr, batch, rank, WORLD: tl.constexpr,
                      BLOCK: tl.constexpr):
    """buf [WORLD, B, 2] fp32: this rank's (score, id) pairs in slot `rank`, zeros in the other
    slots, so that the sum over the ranks is every rank's pairs (an all-gather by all-reduce)."""
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = b < batch
    val = tl.load(val_ptr + b, mask=m, other=0.0)
    idx = tl.load(idx_ptr + b, mask=m, other=0).to(tl.float32)
    for r in tl.static_range(WORLD):
        mine = r == rank
        tl.store(buf_ptr + (r * batch + b) * 2, tl.where(mine, val, 0.0), mask=m)
        tl.store(buf_ptr + (r * batch + b) * 2 + 1, tl.where(mine, idx, 0.0), mask=m)


@triton.jit(do_not_specialize=["batch"])
def _pick_ranks_kernel(buf_ptr, out_ptr, batch, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Per row the id of the highest score over the ranks' slots, ties to the lowest rank."""
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = b < batch
    best = tl.load(buf_ptr + b * 2, mask=m, other=0.0)
    best_id = tl.load(buf_ptr + b * 2 + 1, mask=m, other=0.0)
    for r in tl.static_range(1, WORLD):
        val = tl.load(buf_ptr + (r * batch + b) * 2, mask=m, other=0.0)
        better = val > best  # strict: the lower rank (so the lower id) keeps a tie
        best = tl.where(better, val, best)
        best_id = tl.where(better, tl.load(buf_ptr + (r * batch + b) * 2 + 1, mask=m,
                                           other=0.0), best_id)
    tl.store(out_ptr + b, best_id.to(tl.int64), mask=m)


def default_num_chunks(batch: int, vocab: int, block: int = _BLOCK) -> int:
    return max(1, min(triton.cdiv(vocab, 4 * block), triton.cdiv(_TARGET_PROGRAMS, max(batch, 1))))


def gumbel_argmax(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  num_chunks: int | None = None, temps: torch.Tensor | None = None,
                  block: int = _BLOCK, tok_hash: torch.Tensor | None = None) -> torch.Tensor:
    """argmax_j(x[b, j] / t_b + gumbel(row_key(seeds[b], positions[b]), j)) per row, t_b = 1
    without `temps`; rows with temps[b] <= 0 take argmax_j x[b, j]. x [B, V] float32, bf16 or
    fp16 (rows may be strided, e.g. a vocabulary slice); seeds and positions int64 [B]; temps
    float32 [B]. The row keys are hashed in the kernel: a dozen fewer tiny launches per step
    than computing them with torch ops. `tok_hash` (from `sampling.ops.token_hash_table`) replaces the
    per-token hash by a load: the same tokens, at another balance of ALU and cache work."""
    part_val, part_idx = gumbel_partials(x, seeds, positions, num_chunks, temps, block, tok_hash)
    return best_of_chunks(part_val, part_idx)[1]


def argmax_best(x: torch.Tensor, id_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (max float32, lowest id holding it), [B] each, over x's columns as tokens
    id_offset..: torch.argmax's answer (for rows without NaN) in two launches, where torch's
    reduction over one long row ran on few SMs (24 us for a 76k-token shard at batch 1)."""
    part_val, part_idx = gumbel_partials(x, x, x, greedy=True, id_offset=id_offset)
    return best_of_chunks(part_val, part_idx)


def best_of_chunks(part_val: torch.Tensor, part_idx: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, C] chunk winners -> each row's (score, id): `_best_chunk_kernel`."""
    batch, num_chunks = part_val.shape
    val = torch.empty(batch, dtype=part_val.dtype, device=part_val.device)
    idx = torch.empty(batch, dtype=part_idx.dtype, device=part_idx.device)
    if batch:
        _best_chunk_kernel[(batch,)](part_val, part_idx, val, idx, num_chunks,
                                     BLOCK_C=max(_MIN_BLOCK_C, triton.next_power_of_2(num_chunks)),
                                     num_warps=1)
    return val, idx


def pack_slot(scores: torch.Tensor, ids: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """[world, B, 2] fp32 with (scores, ids) in slot `rank` and zeros elsewhere: summed over the
    ranks (exactly: x + 0 = x) it holds every rank's pairs. ids must be below 2**24."""
    batch = scores.shape[0]
    buf = torch.empty(world, batch, 2, dtype=torch.float32, device=scores.device)
    if batch:
        _pack_slot_kernel[(triton.cdiv(batch, 256),)](scores, ids, buf, batch, rank,
                                                      WORLD=world, BLOCK=256, num_warps=4)
    return buf


def pick_ranks(buf: torch.Tensor) -> torch.Tensor:
    """`pack_slot` buffers summed over the ranks -> the winning id of each row, int64 [B]."""
    world, batch, _ = buf.shape
    out = torch.empty(batch, dtype=torch.int64, device=buf.device)
    if batch:
        _pick_ranks_kernel[(triton.cdiv(batch, 256),)](buf, out, batch, WORLD=world,
                                                       BLOCK=256, num_warps=4)
    return out


def gumbel_best(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                num_chunks: int | None = None, temps: torch.Tensor | None = None,
                block: int = _BLOCK, tok_hash: torch.Tensor | None = None,
                id_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's winning (score float32, token id int64), [B] each, as in `gumbel_argmax`. With
    `id_offset`, column j of x is token id_offset + j (one TP rank's vocabulary shard: noise,
    ids and a `tok_hash` table are those of the global ids), so the shards' winners compare by
    score, ties to the lowest id, to the draw over the whole vocabulary."""
    part_val, part_idx = gumbel_partials(x, seeds, positions, num_chunks, temps, block, tok_hash,
                                         id_offset)
    return best_of_chunks(part_val, part_idx)


def gumbel_partials(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                    num_chunks: int | None = None, temps: torch.Tensor | None = None,
                    block: int = _BLOCK, tok_hash: torch.Tensor | None = None,
                    id_offset: int = 0, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's best (score, index), [B, C] float32 and int64: the scores let checks compare
    two paths bit for bit at many points per row, not only at the winning token. `greedy`: the
    plain maximum (seeds, positions, temps and tok_hash unread)."""
    batch, vocab = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if positions.stride(0) != 1 and not greedy:
        positions = positions.contiguous()
    if num_chunks is None:
        num_chunks = default_num_chunks(batch, vocab, block)
    chunk = triton.cdiv(triton.cdiv(vocab, num_chunks), block) * block
    num_chunks = triton.cdiv(vocab, chunk)
    part_val = torch.empty(batch, num_chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(batch, num_chunks, dtype=torch.int64, device=x.device)
    has_temp = temps is not None
    temp_stride = temps.stride(0) if temps is not None else 0
    _gumbel_argmax_kernel[(batch, num_chunks)](
        x, seeds, positions, temps if has_temp else part_val,
        tok_hash if tok_hash is not None else part_val, part_val, part_idx, vocab,
        id_offset, x.stride(0), seeds.stride(0), temp_stride, chunk, num_chunks,
        HAS_TEMP=has_temp and not greedy, TOK_TABLE=tok_hash is not None and not greedy,
        BLOCK=block, GREEDY=greedy, num_warps=4)
    return part_val, part_idx
