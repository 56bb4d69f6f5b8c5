"""The one-pass draw over logits in the model's dtype: bit for bit the tokens of the old path
(upcast to fp32, divide by the temperature, draw; argmax for greedy rows), with the Triton kernel
under the interpreter and with the torch fallback, and through the Sampler and the LM head."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_core.sampling import SamplingParams  # noqa: E402
from minisgl_worker.kernels import sampling as tsampling  # noqa: E402
from minisgl_worker.layers.embedding import ParallelLMHead  # noqa: E402
from minisgl_worker.sampling import Sampler, ops  # noqa: E402

if type(tsampling._gumbel_argmax_kernel).__name__ != "InterpretedFunction":
    importlib.reload(tsampling)

CPU = torch.device("cpu")
VOCAB = 2500  # several blocks per chunk and a ragged tail


def old_path(logits: torch.Tensor, temps: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
             positions: torch.Tensor, triton: bool) -> torch.Tensor:
    """What the sampler did before: fp32 logits from the LM head, greedy argmax, x / temperature
    (1 on rows with temperature <= 0), then the draw on pre-divided fp32 logits."""
    x = logits.float()
    greedy_tokens = x.argmax(dim=1)
    x = x / torch.where(temps > 0, temps, 1.0)[:, None]
    if triton:
        tokens = tsampling.gumbel_argmax(x, seeds, positions)
    else:
        keys = ops.row_keys(seeds, positions)
        tokens = ops.gumbel_argmax_torch(x, keys, ops.token_hashes(x.shape[1], CPU))
    return torch.where(greedy, greedy_tokens, tokens)


def make_batch(batch: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, VOCAB, generator=gen) * 4).to(dtype)
    logits[0, ::3] = -math.inf  # filtered tokens, as a model's -inf bias would leave them
    # Rows of temperature 0 are greedy; the others span the usual range and odd values whose
    # division rounds differently from a multiplication by the reciprocal.
    choices = torch.tensor([0.0, 0.6, 0.7, 1.0, 1.3, 0.1, 2.9, 0.33])
    temps = choices[torch.randint(0, len(choices), (batch,), generator=gen)]
    temps[0], temps[1] = 0.6, 0.0
    seeds = torch.randint(0, 2**63 - 1, (batch,), generator=gen)
    seeds[2 % batch] = 2**63 - 1
    positions = torch.randint(0, 2**20, (batch,), generator=gen)
    return logits, temps, seeds, positions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_draw_equals_old_path(dtype: torch.dtype, seed: int):
    logits, temps, seeds, positions = make_batch(12, seed, dtype)
    greedy = temps <= 0
    want_triton = old_path(logits, temps, greedy, seeds, positions, triton=True)
    want_torch = old_path(logits, temps, greedy, seeds, positions, triton=False)
    for chunks in (1, 3):
        got = tsampling.gumbel_argmax(logits, seeds, positions, chunks, temps=temps)
        assert got.tolist() == want_triton.tolist()
    table = ops.token_hash_table(VOCAB, CPU)  # the table variant: the same bits
    got = tsampling.gumbel_argmax(logits, seeds, positions, 2, temps=temps, tok_hash=table)
    assert got.tolist() == want_triton.tolist()
    got = ops.gumbel_argmax_torch(logits, ops.row_keys(seeds, positions),
                                  ops.token_hashes(VOCAB, CPU), temps=temps)
    assert got.tolist() == want_torch.tolist()
    assert want_triton.tolist() == want_torch.tolist()  # the two backends agree here too
    assert int(want_triton[0]) % 3 != 0
    # The test has teeth: the temperature changes some draws.
    assert want_triton.tolist() != old_path(logits, torch.ones(12), greedy, seeds, positions,
                                            triton=True).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_scores_equal_old_kernel(dtype: torch.dtype):
    """Bit for bit at every chunk's best score, not only at the winning token (small blocks:
    20 chunks a row), between the kernel on pre-divided fp32 logits and the fused one."""
    logits, temps, seeds, positions = make_batch(6, 4, dtype)
    sampled = temps > 0
    x32 = logits.float() / torch.where(sampled, temps, 1.0)[:, None]
    old_val, old_idx = tsampling.gumbel_partials(x32, seeds, positions, 20, block=128)
    new_val, new_idx = tsampling.gumbel_partials(logits, seeds, positions, 20, temps, block=128)
    assert torch.equal(new_val[sampled], old_val[sampled])
    assert torch.equal(new_idx[sampled], old_idx[sampled])
    table = ops.token_hash_table(VOCAB, CPU)
    tab_val, _ = tsampling.gumbel_partials(logits, seeds, positions, 20, temps, 128, table)
    assert torch.equal(tab_val, new_val)
    greedy = torch.full((int((~sampled).sum()), 20 * 128), -math.inf)  # chunks of 128
    greedy[:, :VOCAB] = logits[~sampled].float()  # greedy rows: the raw logits, no noise
    assert torch.equal(new_val[~sampled], greedy.view(len(greedy), 20, 128).amax(dim=2))


@pytest.mark.parametrize("temp", [0.6, 0.1, 1.3, 2.9])
def test_division_rounds_like_torch(temp: float):
    """Rows whose token hangs on the last bit of x / t: two adjacent fp32 logits so large that
    the noise is absorbed, so token 0 wins iff fl(x0 / t) == fl(x1 / t) (a tie). Half the rows
    are chosen where x * (1 / t) would decide the other way: a kernel that does not divide with
    round-to-nearest like torch fails here (random logits almost never notice one ulp)."""
    gen = torch.Generator().manual_seed(int(temp * 10))
    t = torch.tensor(temp)
    sign = torch.where(torch.rand(4096, generator=gen) < 0.5, 1.0, -1.0)
    v = (torch.rand(4096, generator=gen) + 1) * 1e30 * sign
    v1 = torch.nextafter(v, torch.tensor(math.inf))
    tie = (v / t) == (v1 / t)
    sensitive = tie != ((v * (1 / t)) == (v1 * (1 / t)))
    rows = torch.cat([v[sensitive][:8], v[~sensitive][:8]])
    logits = torch.full((16, VOCAB), -math.inf)
    logits[:, 0], logits[:, 1] = rows, torch.nextafter(rows, torch.tensor(math.inf))
    temps, seeds, positions = torch.full((16,), temp), torch.arange(16) * 7, torch.arange(16)
    want = old_path(logits, temps, temps <= 0, seeds, positions, triton=True)
    assert want.tolist() == torch.where(torch.cat([tie[sensitive][:8], tie[~sensitive][:8]]),
                                        0, 1).tolist()
    assert tsampling.gumbel_argmax(logits, seeds, positions, temps=temps).tolist() == want.tolist()


def test_greedy_rows_tie_break_like_argmax():
    """bf16 logits tie often; a greedy row must pick the lowest tied index, in every chunk
    layout, as torch.argmax over the fp32 copy does."""
    logits = torch.full((3, VOCAB), -2.0, dtype=torch.bfloat16)
    logits[0, [17, 1100, 2400]] = 3.0
    logits[1, [2048, 2049]] = 1.0
    logits[2] = -math.inf  # nothing left: index 0, like argmax
    temps, seeds, positions = torch.zeros(3), torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    for chunks in (1, 2, 3):
        got = tsampling.gumbel_argmax(logits, seeds, positions, chunks, temps=temps)
        assert got.tolist() == [17, 2048, 0] == logits.float().argmax(dim=1).tolist()


def test_strided_rows_as_the_lm_head_leaves_them():
    """With tensor parallelism the padded vocabulary is cut off as a view: rows are strided."""
    logits, temps, seeds, positions = make_batch(5, 3, torch.bfloat16)
    wide = torch.full((5, VOCAB + 12), 50.0, dtype=torch.bfloat16)  # padding would win if read
    wide[:, :VOCAB] = logits
    view = wide[:, :VOCAB]
    assert not view.is_contiguous()
    got = tsampling.gumbel_argmax(view, seeds, positions, 2, temps=temps)
    assert got.tolist() == old_path(logits, temps, temps <= 0, seeds, positions, True).tolist()


# -- through the Sampler -------------------------------------------------------------------------


def _params(kind: str, seed: int | None = None) -> SamplingParams:
    return {
        "greedy": SamplingParams(temperature=0.0),
        "top1": SamplingParams(temperature=0.7, top_k=1),  # greedy whatever the temperature
        "t06": SamplingParams(temperature=0.6, seed=seed),
        "t13": SamplingParams(temperature=1.3, seed=seed),
        "topk": SamplingParams(temperature=0.8, top_k=20, seed=seed),
        "rep": SamplingParams(temperature=0.9, repetition_penalty=1.2, seed=seed),
        "logprobs": SamplingParams(temperature=0.6, logprobs=True, seed=seed),
    }[kind]


def _sample(kinds: list[str], logits: torch.Tensor, use_triton: bool, steps: int = 3,
            spy: list | None = None) -> list[list[int]]:
    s = Sampler(len(kinds), VOCAB, CPU, seed=5, use_triton=use_triton)
    for slot, kind in enumerate(kinds):
        s.set_slot(slot, _params(kind, seed=100 + slot), [7, 8])
    slots = list(range(len(kinds)))
    out = []
    for step in range(steps):
        positions = torch.tensor([3 + step + 10 * i for i in slots])
        out.append(s.sample(logits, torch.tensor(slots), positions, host_slots=slots)
                   .token_ids.tolist())
    return out


def _reference(kinds: list[str], logits: torch.Tensor, use_triton: bool,
               steps: int = 3) -> list[list[int]]:
    temps = torch.tensor([_params(k).temperature for k in kinds])
    greedy = torch.tensor([k in ("greedy", "top1") for k in kinds])
    seeds = torch.tensor([100 + i for i in range(len(kinds))])
    return [old_path(logits, temps, greedy, seeds,
                     torch.tensor([3 + step + 10 * i for i in range(len(kinds))]),
                     use_triton).tolist() for step in range(steps)]


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("kinds", [
    ["t06", "t13", "t06"],
    ["greedy", "t06", "top1", "t13"],
    ["greedy", "top1"],
], ids=["temperature", "mixed", "greedy"])
def test_sampler_fused_path_equals_old_path(kinds: list[str], use_triton: bool,
                                            monkeypatch: pytest.MonkeyPatch):
    logits = make_batch(len(kinds), 7, torch.bfloat16)[0]
    seen: list[tuple[torch.dtype, bool]] = []
    draw = ops.gumbel_argmax

    def spy(x, *args, **kw):  # noqa: ANN001, ANN002, ANN003
        seen.append((x.dtype, kw.get("temps") is not None))
        return draw(x, *args, **kw)

    monkeypatch.setattr(ops, "gumbel_argmax", spy)
    got = _sample(kinds, logits, use_triton)
    assert got == _reference(kinds, logits, use_triton)
    # One draw per step straight on the bf16 logits (none at all for an all-greedy batch).
    sampled = any(k.startswith("t") and k != "top1" for k in kinds)
    assert seen == ([(torch.bfloat16, True)] * 3 if sampled else [])


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("other", ["topk", "rep", "logprobs"])
def test_sampler_processed_batches_upcast_as_before(other: str, use_triton: bool):
    """A batch that needs fp32 processing gives the same tokens from bf16 logits as from their
    fp32 copy (the conversion moved from the LM head into the sampler)."""
    kinds = ["t06", other, "greedy"]
    logits = make_batch(len(kinds), 11, torch.bfloat16)[0]
    assert _sample(kinds, logits, use_triton) == _sample(kinds, logits.float(), use_triton)


def test_lm_head_returns_the_activation_dtype():
    head = ParallelLMHead(VOCAB, 16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, 16))
    head = head.to(torch.bfloat16)
    hidden = torch.randn(4, 16, dtype=torch.bfloat16)
    raw = head(hidden, fp32=False)
    full = head(hidden)
    assert raw.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert raw.shape == full.shape == (4, VOCAB)
    assert torch.equal(raw.float(), full)
