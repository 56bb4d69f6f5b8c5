"""The draw at TP > 1 from each rank's vocabulary shard (sampling/sharded.py): over 2 and 3
simulated shards, the same tokens bit for bit as the one-pass draw over the whole vocabulary,
with the Triton kernel under the interpreter and with the torch path, and through the Sampler
(ranks as threads that exchange their packs at a barrier, as the all-gather does). Real ranks
over gloo: tests/worker/test_tp.py."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import math  # noqa: E402
import threading  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_core.sampling import SamplingParams  # noqa: E402
from minisgl_worker.kernels import sampling as tsampling  # noqa: E402
from minisgl_worker.sampling import Sampler, ops  # noqa: E402
from minisgl_worker.sampling.sharded import (  # noqa: E402
    Combine,
    VocabShard,
    pack,
    pick_best,
    pick_packed,
    shard_best,
)

if type(tsampling._gumbel_argmax_kernel).__name__ != "InterpretedFunction":
    importlib.reload(tsampling)

CPU = torch.device("cpu")
VOCAB = 2501  # odd: the last of 2 (and of 3) shards holds padding columns
PAD_VALUE = 1e4  # what a padding column holds here: it would win every row if it were read


def shards(logits: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each rank's columns as the LM head leaves them: blocks of ceil(V / tp), the last one
    running into the padding."""
    local = -(-logits.shape[1] // tp)
    wide = torch.full((logits.shape[0], local * tp), PAD_VALUE, dtype=logits.dtype)
    wide[:, : logits.shape[1]] = logits
    return [wide[:, r * local : (r + 1) * local] for r in range(tp)]


def sharded_draw(logits: torch.Tensor, tp: int, temps: torch.Tensor | None, seeds: torch.Tensor,
                 positions: torch.Tensor, use_triton: bool) -> torch.Tensor:
    vocab = logits.shape[1]
    tok_hash = ops.token_hashes(vocab, CPU)
    packs = [pack(*shard_best(x, VocabShard.of_rank(vocab, r, tp), seeds, positions, temps,
                              tok_hash, use_triton))
             for r, x in enumerate(shards(logits, tp))]
    return pick_packed(torch.stack(packs))


def full_draw(logits: torch.Tensor, temps: torch.Tensor | None, seeds: torch.Tensor,
              positions: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """What the sampler's one-pass path draws from the gathered logits."""
    if temps is None:
        return logits.argmax(dim=1)
    return ops.gumbel_argmax(logits, seeds, positions, ops.token_hashes(logits.shape[1], CPU),
                             temps=temps, use_triton=use_triton)


def make_batch(batch: int, seed: int, dtype: torch.dtype, kind: str):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, VOCAB, generator=gen) * 4).to(dtype)
    logits[0, ::3] = -math.inf  # filtered tokens
    temps = torch.tensor([0.6, 1.3, 0.1, 2.9, 0.7, 1.0])[torch.arange(batch) % 6]
    if kind == "mixed":
        temps[::3] = 0.0  # greedy rows among sampled ones, as one kernel launch serves them
    seeds = torch.randint(0, 2**63 - 1, (batch,), generator=gen)
    positions = torch.randint(0, 2**20, (batch,), generator=gen)
    return logits, (None if kind == "greedy" else temps), seeds, positions


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("kind", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tp", [2, 3])
def test_sharded_draw_equals_the_full_vocabulary_draw(tp: int, dtype: torch.dtype, kind: str,
                                                       use_triton: bool):
    logits, temps, seeds, positions = make_batch(12, tp * 10 + len(kind), dtype, kind)
    want = full_draw(logits, temps, seeds, positions, use_triton)
    got = sharded_draw(logits, tp, temps, seeds, positions, use_triton)
    assert got.tolist() == want.tolist()
    assert int(got[0]) % 3 != 0
    # Teeth: winners come from every shard, and sampled rows are not their argmax.
    local = -(-VOCAB // tp)
    assert {int(t) // local for t in got} == set(range(tp))
    if temps is not None:
        assert (got != logits.argmax(dim=1))[temps > 0].any()


def test_kernel_on_a_shard_scores_its_global_ids():
    """The kernel's id offset: a shard's best (score, id), with the inline hash and with the
    table, is the full vocabulary's best over the same columns, bit for bit."""
    logits, temps, seeds, positions = make_batch(5, 3, torch.bfloat16, "mixed")
    start, size = 1024, 700
    window = torch.full_like(logits, -math.inf)
    window[:, start : start + size] = logits[:, start : start + size]
    want_val, want_idx = tsampling.gumbel_best(window, seeds, positions, temps=temps)
    table = ops.token_hash_table(VOCAB, CPU)
    for tok_hash, chunks in ((None, 1), (None, 3), (table, 2)):
        val, idx = tsampling.gumbel_best(logits[:, start : start + size], seeds, positions,
                                         chunks, temps, tok_hash=tok_hash, id_offset=start)
        assert torch.equal(val, want_val) and idx.tolist() == want_idx.tolist()
    keys = ops.row_keys(seeds, positions)
    tval, tidx = ops.gumbel_best_torch(logits[:, start : start + size], keys,
                                       ops.token_hashes(VOCAB, CPU)[start : start + size],
                                       temps=temps, id_offset=start)
    assert tidx.tolist() == want_idx.tolist()


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_ties_across_shards_go_to_the_lowest_id(use_triton: bool):
    """A tie between two ranks' winners is the lower rank's, the lowest id, as torch.argmax
    over the gathered logits picks; noise cannot separate logits of 1e30 (sampled rows)."""
    local = -(-VOCAB // 2)
    logits = torch.full((4, VOCAB), -2.0, dtype=torch.bfloat16)
    logits[0, [local - 1, local]] = 3.0  # across the boundary
    logits[1, [2000, 17]] = 3.0
    logits[2:, [local + 5, 40]] = 1e30
    temps = torch.tensor([0.0, 0.0, 0.7, 1.3])
    seeds, positions = torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8])
    want = [local - 1, 17, 40, 40]
    assert full_draw(logits, temps, seeds, positions, use_triton).tolist() == want
    assert sharded_draw(logits, 2, temps, seeds, positions, use_triton).tolist() == want
    assert sharded_draw(logits[:2], 2, None, seeds[:2], positions[:2], use_triton).tolist() \
        == want[:2]
    # pick_best alone: equal scores on every rank -> rank 0's id.
    assert pick_best(torch.zeros(3, 2), torch.tensor([[1, 2], [5, 6], [9, 9]])).tolist() == [1, 2]


def test_triton_argmax_is_torch_argmax_with_its_ties():
    """The greedy kernel (chunk winners, then the first best chunk): torch.argmax's id, ties to
    the lowest within a chunk and across chunks, on strided bf16 rows, with a global id offset,
    and its score the logit itself."""
    gen = torch.Generator().manual_seed(4)
    wide = (torch.randn(5, 2 * VOCAB, generator=gen) * 3).to(torch.bfloat16)
    x = wide[:, 100 : 100 + VOCAB]  # strided rows
    x[1, [7, 2400]] = 50.0  # a tie across chunks
    x[2, [1025, 1030]] = 50.0  # within one
    x[3, :] = -math.inf  # nothing drawable: torch says 0
    for chunks in (None, 1, 3):
        part_val, part_idx = tsampling.gumbel_partials(x, x, x, chunks, greedy=True,
                                                       id_offset=9000)
        val, idx = tsampling.best_of_chunks(part_val, part_idx)
        want = x.argmax(dim=1)
        assert (idx[[0, 1, 2, 4]] - 9000).tolist() == want[[0, 1, 2, 4]].tolist()
        assert idx[1] == 9007 and idx[2] == 10025
        assert torch.equal(val[[0, 1, 2, 4]], x.float().gather(1, want[:, None])[[0, 1, 2, 4], 0])
    val, idx = tsampling.argmax_best(x)
    assert idx[[0, 1, 2, 4]].tolist() == x.argmax(dim=1)[[0, 1, 2, 4]].tolist()


@pytest.mark.parametrize("world", [2, 3])
def test_pack_slot_sum_and_pick_is_the_gathered_pick(world: int):
    """The all-gather by all-reduce of the GPU exchange: each rank's pairs in its slot of a zero
    buffer, the buffers summed in rank order (as the one-shot all-reduce sums), then the pick
    over the ranks: the same ids as pick_best over the gathered pairs, ties to the lowest rank,
    ids up to 2**24 - 1 exact, -inf scores (a rank of padding) never winning."""
    gen = torch.Generator().manual_seed(world)
    batch = 300  # more rows than one program's block
    scores = torch.randn(world, batch, generator=gen).round(decimals=1)  # ties between ranks
    scores[-1, :5] = -math.inf
    ids = torch.stack([torch.randint(r * 5_000_000, (r + 1) * 5_000_000, (batch,),
                                     generator=gen) for r in range(world)])
    ids[-1, -1] = (1 << 24) - 1
    bufs = [tsampling.pack_slot(scores[r], ids[r], r, world) for r in range(world)]
    total = bufs[0]
    for b in bufs[1:]:
        total = total + b
    assert torch.equal(total[:, :, 1].to(torch.int64), ids)
    got = tsampling.pick_ranks(total)
    assert got.tolist() == pick_best(scores, ids).tolist()
    assert (scores.max(dim=0).values == scores[0]).sum() < batch  # teeth: not all rank 0


@pytest.mark.parametrize(("vocab", "tp"), [(2501, 2), (2501, 3), (512, 2), (5, 4)])
def test_shards_match_the_lm_head_layout(vocab: int, tp: int, monkeypatch: pytest.MonkeyPatch):
    """VocabShard.of_rank names the tokens whose rows each rank's LM head loads: column j of
    its local logits is token start + j, and the columns past `size` are padding."""
    from minisgl_worker.distributed import TPState
    from minisgl_worker.layers import embedding

    weight = torch.arange(1, vocab + 1, dtype=torch.float32)[:, None].repeat(1, 4)  # row i: i+1
    for rank in range(tp):
        monkeypatch.setattr(embedding, "tp", lambda r=rank: TPState(rank=r, size=tp))
        head = embedding.ParallelLMHead(vocab, 4)
        head._load(head.weight, weight)
        shard = VocabShard.of_rank(vocab, rank, tp)
        col = head.local_logits(torch.tensor([[0.25] * 4]))[0]  # = token id + 1, 0 on padding
        assert col[: shard.size].tolist() == [float(shard.start + j + 1)
                                              for j in range(shard.size)]
        assert not col[shard.size :].any()


def test_a_last_rank_of_padding_only_never_wins():
    """V=5 over 4 ranks: blocks of 2, so rank 3 holds only padding (VocabParallelEmbedding)."""
    assert [VocabShard.of_rank(5, r, 4) for r in range(4)] == [
        VocabShard(0, 2), VocabShard(2, 2), VocabShard(4, 1), VocabShard(6, 0)]
    logits = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    seeds, positions = torch.tensor([1, 2]), torch.tensor([3, 4])
    assert sharded_draw(logits, 4, None, seeds, positions, False).tolist() == [0, 4]
    temps = torch.tensor([0.5, 0.9])
    want = full_draw(logits, temps, seeds, positions, False)
    assert sharded_draw(logits, 4, temps, seeds, positions, False).tolist() == want.tolist()


# -- through the Sampler, ranks as threads -------------------------------------------------------


class ThreadExchange:
    """The all-gather of `exchange_best` among threads: each rank's pack, then the same pick."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=60)
        self.packs: list[torch.Tensor] = [torch.empty(0)] * n

    def combine(self, rank: int) -> Combine:
        def run(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            self.packs[rank] = pack(scores, ids)
            self.barrier.wait()
            out = pick_packed(torch.stack(self.packs))
            self.barrier.wait()  # every rank has read the packs before the next step writes
            return out

        return run


PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "top1": SamplingParams(temperature=0.7, top_k=1),  # greedy whatever the temperature
    "t06": SamplingParams(temperature=0.6, seed=11),
    "t13": SamplingParams(temperature=1.3),  # unseeded: the sampler's generator, alike per rank
    "topk": SamplingParams(temperature=0.8, top_k=20, seed=12),
    "logprobs": SamplingParams(temperature=0.6, logprobs=True),
    "min_tokens": SamplingParams(temperature=0.6, min_tokens=2, stop_token_ids=[3]),
    "bias": SamplingParams(temperature=0.6, logit_bias={5: 2.0}),
}


def new_sampler(kinds: list[str], use_triton: bool) -> Sampler:
    s = Sampler(len(kinds), VOCAB, CPU, seed=5, use_triton=use_triton)
    for slot, kind in enumerate(kinds):
        s.set_slot(slot, PARAMS[kind], [7, 8])
    return s


@pytest.mark.parametrize("tp", [2, 3])
def test_sampler_sharded_equals_sample(tp: int):
    """The torch draw (the Triton interpreter does not run in several threads at once; the
    kernel's shards are checked above)."""
    use_triton = False
    kinds = ["greedy", "t06", "top1", "t13", "t06"]
    slots = list(range(len(kinds)))
    full = new_sampler(kinds, use_triton)
    ranks = [new_sampler(kinds, use_triton) for _ in range(tp)]
    exchange = ThreadExchange(tp)
    gen = torch.Generator().manual_seed(tp)
    with ThreadPoolExecutor(tp) as pool:
        for step in range(3):
            logits = (torch.randn(len(kinds), VOCAB, generator=gen) * 3).to(torch.bfloat16)
            positions = torch.tensor([3 + step + 10 * i for i in slots])
            assert full.shardable(slots) and all(r.shardable(slots) for r in ranks)
            want = full.sample(logits, torch.tensor(slots), positions, slots).token_ids
            parts = shards(logits, tp)
            # Odd ranks get the plan asked first (as the runner passes it), even ones build it.
            futures = [pool.submit(r.sample_sharded, parts[i], torch.tensor(slots), positions,
                                   slots, VocabShard.of_rank(VOCAB, i, tp), exchange.combine(i),
                                   plan=r.shard_plan(slots) if i % 2 else None)
                       for i, r in enumerate(ranks)]
            for f in futures:
                assert f.result().token_ids.tolist() == want.tolist()


@pytest.mark.parametrize("other", ["topk", "logprobs", "min_tokens", "bias"])
def test_batches_that_need_the_full_vocabulary_are_not_shardable(other: str):
    s = new_sampler(["t06", "greedy", other], use_triton=False)
    assert s.shardable([0, 1]) and not s.shardable([0, 2]) and not s.shardable([2])
    assert s.shard_plan([0, 1]) is not None and s.shard_plan([0, 2]) is None
    assert s.shard_plan([]) is None
    logits = torch.zeros(2, VOCAB)
    with pytest.raises(ValueError, match="full vocabulary"):
        s.sample_sharded(logits, torch.tensor([0, 2]), torch.tensor([1, 1]), [0, 2],
                         VocabShard(0, VOCAB), ThreadExchange(1).combine(0))
