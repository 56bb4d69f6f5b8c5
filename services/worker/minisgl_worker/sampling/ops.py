"""Tensor ops behind `Sampler`: logit processors and a seeded Gumbel-max draw.

Randomness is a counter-based hash, not a generator stream: the noise of token j when sampling
position p of a request with seed s is a pure function of (s, p, j). So a seeded request draws the
same tokens whatever else shares its batch, whichever slot it sits in, and on CPU or GPU. The hash
runs in 32-bit lanes held in int64 tensors (every intermediate < 2**63, so no signed overflow and
`>>` is a logical shift), which makes it exact in plain torch integer ops; the Triton kernel below
computes the same bits in uint32 and fuses noise + argmax into one pass over the logits.

Sampling is an exponential race: token = argmax_j(x_j + g_j) with g_j = -log(-log(u_j)) Gumbel
noise, u_j uniform in (0, 1) with 24 random bits. That equals a draw from softmax(x) (x already
divided by the temperature, filtered tokens at -inf). Given per-row temperatures the draw divides
by them itself (rows at temperature <= 0 take the plain argmax): with no filter in between, the
logits are then read once, in the model's dtype, instead of converted and divided in full passes.
"""

from __future__ import annotations

import math

import torch

M32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D  # multipliers of Wellons' "lowbias32" integer hash
_MUL2 = 0x846CA68B
_SEED_SALT = 0x9E3779B9
_TOKEN_SALT = 0x85EBCA6B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), exact in int64: a factor >= 2**31 is split in halves
    of 16 bits so that no product reaches 2**63."""
    if c < 2**31:
        return (x * c) & M32
    hi, lo = c >> 16, c & 0xFFFF
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash; int64 tensor with values in [0, 2**32) in and out."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] int64 keys in [0, 2**32) from per-row seeds (< 2**63) and sequence positions."""
    k = hash32((seeds & M32) ^ _SEED_SALT)
    k = hash32(k ^ ((seeds >> 32) & M32))
    return hash32(k ^ (positions & M32))


def token_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    return hash32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _TOKEN_SALT)


def token_hash_table(vocab_size: int, device: torch.device) -> torch.Tensor:
    """`token_hashes` as int32 bit patterns: the Triton draw's `tok_hash=` table."""
    h = token_hashes(vocab_size, device)
    return (h - ((h >> 31) << 32)).to(torch.int32)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """The top 23 of 32 hash bits as a float32 in [2**-24, 1 - 2**-24]; every step is exact in
    float32. (With 24 bits, k + 0.5 rounds to 2**24 for the top pattern: u = 1, noise +inf, and
    the token won whatever its logit; a masked -inf logit became NaN, which argmax picks.)"""
    return ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)


def gumbel_noise(keys: torch.Tensor, tok_hash: torch.Tensor) -> torch.Tensor:
    """[B, V] Gumbel noise for rows with `keys` [B] over tokens with hashes `tok_hash` [V]."""
    u = uniform_from_bits(hash32(keys[:, None] ^ tok_hash[None, :]))
    return -torch.log(-torch.log(u))


def gumbel_argmax_torch(x: torch.Tensor, keys: torch.Tensor, tok_hash: torch.Tensor,
                        chunk: int = 1 << 15, *, temps: torch.Tensor | None = None) -> torch.Tensor:
    """argmax(x + noise) per row, in vocabulary chunks to bound the int64 temporaries. With
    `temps` [B]: argmax(x / t + noise), and argmax(x) on rows with t <= 0 (greedy). x of any
    float dtype is upcast to float32 first (exact for bf16/fp16)."""
    x = x.to(torch.float32)
    if temps is not None:
        greedy = temps <= 0
        greedy_tokens = x.argmax(dim=1)
        x = x / torch.where(greedy, 1.0, temps)[:, None]
        sampled = gumbel_argmax_torch(x, keys, tok_hash, chunk)
        return torch.where(greedy, greedy_tokens, sampled)
    if x.shape[1] <= chunk:
        return (x + gumbel_noise(keys, tok_hash)).argmax(dim=1)
    best_val = torch.full((x.shape[0],), -math.inf, dtype=torch.float32, device=x.device)
    best_idx = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    for start in range(0, x.shape[1], chunk):
        part = x[:, start : start + chunk] + gumbel_noise(keys, tok_hash[start : start + chunk])
        val, idx = part.max(dim=1)
        better = val > best_val  # strict: ties keep the earlier chunk, like torch.argmax
        best_val = torch.where(better, val, best_val)
        best_idx = torch.where(better, idx + start, best_idx)
    return best_idx


def gumbel_best_torch(x: torch.Tensor, keys: torch.Tensor, tok_hash: torch.Tensor,
                      chunk: int = 1 << 15, *, temps: torch.Tensor | None = None,
                      id_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the winner of `gumbel_argmax_torch` as (score float32, token id int64), [B] each:
    the score is x / t + noise, or x on greedy rows (t <= 0). Column j of x is token
    id_offset + j and `tok_hash` holds those tokens' hashes (one TP rank's vocabulary shard), so
    every element scores as in the draw over the whole vocabulary."""
    x = x.to(torch.float32)
    greedy = scale = None
    if temps is not None:
        greedy = temps <= 0
        scale = torch.where(greedy, 1.0, temps)[:, None]
    best_val = torch.full((x.shape[0],), -math.inf, dtype=torch.float32, device=x.device)
    best_idx = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    for start in range(0, x.shape[1], chunk):
        raw = x[:, start : start + chunk]
        part = (raw if scale is None else raw / scale) + gumbel_noise(
            keys, tok_hash[start : start + chunk])
        if greedy is not None:
            part = torch.where(greedy[:, None], raw, part)
        idx = part.argmax(dim=1, keepdim=True)
        val = part.gather(1, idx).squeeze(1)
        better = val > best_val  # strict: ties keep the earlier chunk, like torch.argmax
        best_val = torch.where(better, val, best_val)
        best_idx = torch.where(better, idx.squeeze(1) + start, best_idx)
    return best_val, best_idx + id_offset


def gumbel_argmax_triton(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                         num_chunks: int | None = None, *,
                         temps: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as `gumbel_argmax_torch` with row_keys(seeds, positions) (up to the float
    rounding of log on exact near-ties) in one fused pass; CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1."""
    from ..kernels import sampling as kern

    return kern.gumbel_argmax(x, seeds, positions, num_chunks, temps=temps)


def gumbel_argmax(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  tok_hash: torch.Tensor | None, *, temps: torch.Tensor | None = None,
                  use_triton: bool | None = None) -> torch.Tensor:
    """The draw: the fused Triton kernel (default on CUDA), torch ops otherwise (tok_hash needed
    there). Both read x in its own dtype; `temps` as in `gumbel_argmax_torch`."""
    if use_triton is None:
        use_triton = x.is_cuda
    if use_triton:
        return gumbel_argmax_triton(x, seeds, positions, temps=temps)
    assert tok_hash is not None
    return gumbel_argmax_torch(x, row_keys(seeds, positions), tok_hash, temps=temps)


def greedy_argmax(x: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """x.argmax(dim=1); with use_triton the two-launch kernel (kernels/sampling.argmax_best),
    the same ids for rows without NaN: torch's reduction spreads one long row over few SMs."""
    if not use_triton:
        return x.argmax(dim=1)
    from ..kernels import sampling as kern

    return kern.argmax_best(x)[1]


def gumbel_best(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                tok_hash: torch.Tensor | None, *, temps: torch.Tensor | None = None,
                id_offset: int = 0, use_triton: bool | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gumbel_argmax`'s winner per row as (score, global token id) over x's columns, which are
    tokens id_offset.. (a TP rank's vocabulary shard). `tok_hash`: the whole vocabulary's hashes
    (torch path only; the shard's rows are used)."""
    if use_triton is None:
        use_triton = x.is_cuda
    if use_triton:
        from ..kernels import sampling as kern

        return kern.gumbel_best(x, seeds, positions, temps=temps, id_offset=id_offset)
    assert tok_hash is not None
    return gumbel_best_torch(x, row_keys(seeds, positions),
                             tok_hash[id_offset : id_offset + x.shape[1]], temps=temps,
                             id_offset=id_offset)


# -- logit processors (out of place; per-row parameters as [B] tensors) ------------------------


def apply_repetition_penalty(x: torch.Tensor, seen: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """HF semantics: a seen token's positive logit is divided by the penalty, a negative one
    multiplied. `seen` [B, V] bool covers prompt and output; penalty 1 leaves a row unchanged."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(x > 0, x / p, x * p), x)


def apply_presence_frequency(x: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI semantics over output tokens: x -= frequency * count + presence * (count > 0)."""
    c = counts.to(torch.float32)
    return x - frequency[:, None] * c - presence[:, None] * (c > 0).to(torch.float32)


def mask_stop_tokens(x: torch.Tensor, stop_ids: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """-inf at the stop ids ([B, W], -1 = padding) of rows where `active` [B] (min_tokens not
    reached). Accumulating -inf or 0 keeps duplicate indices harmless."""
    rows = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(stop_ids)
    add = torch.where(active[:, None] & (stop_ids >= 0), -math.inf, 0.0).to(x.dtype)
    return x.index_put((rows, stop_ids.clamp(min=0)), add, accumulate=True)


def apply_top_k(x: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's top_k largest logits (0 = off) without a full sort: threshold at the k-th
    value out of one topk(max_k). Ties at the threshold keep every tied token."""
    vals = x.topk(max_k, dim=1).values
    kth = vals.gather(1, (top_k.clamp(1, max_k) - 1)[:, None])
    kth = torch.where(top_k[:, None] > 0, kth, -math.inf)
    return torch.where(x >= kth, x, -math.inf)


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Top-k (optional) then top-p over the renormalised survivors, with one full sort: keep the
    smallest prefix of the sorted distribution whose mass reaches top_p (at least one token)."""
    sx, order = x.sort(dim=1, descending=True)
    if top_k is not None:
        rank = torch.arange(x.shape[1], device=x.device)[None, :]
        k = torch.where(top_k > 0, top_k, x.shape[1])[:, None]
        sx = sx.masked_fill(rank >= k, -math.inf)
    probs = sx.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    # top_p == 1 must be a no-op even where rounding pushes the cumulative sum past 1.
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sx = sx.masked_fill(drop, -math.inf)
    return torch.empty_like(x).scatter_(1, order, sx)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top one: p_j >= min_p * p_max is
    x_j - x_max >= log(min_p), so no softmax is needed. min_p 0 keeps everything."""
    x_max = x.max(dim=1, keepdim=True).values
    return torch.where(x - x_max >= torch.log(min_p)[:, None], x, -math.inf)

