"""The eager sampling kernels compile once, whatever the batch size: a batch-size class first met
mid-run (a row count of 1 or a multiple of 16, a chunk count past the warm-up's) must not stall
the host while Triton compiles (TP=2 offline on an H100: 5 compiles, 293 ms, in the timed run
before the row and chunk counts stopped being specialised)."""

from __future__ import annotations

import torch

from bench.profile.stalls import host_stalls


def test_sampling_kernels_compile_once_for_every_batch_size() -> None:
    from minisgl_worker.kernels import sampling as kern

    dev = torch.device("cuda")
    vocab = 75_968  # one rank's shard of Qwen3's vocabulary at TP=2

    def draw(batch: int) -> None:
        x = torch.randn(batch, vocab, device=dev, dtype=torch.bfloat16)
        seeds = torch.arange(batch, device=dev, dtype=torch.int64)
        positions = torch.full((batch,), 7, device=dev, dtype=torch.int64)
        temps = torch.full((batch,), 0.6, device=dev)
        scores, ids = kern.gumbel_best(x, seeds, positions, temps=temps, id_offset=vocab)
        kern.argmax_best(x, id_offset=vocab)
        got = kern.pick_ranks(kern.pack_slot(scores, ids, 1, 2))  # slot 0 unsummed: (0.0, id 0)
        assert torch.equal(got, torch.where(scores > 0, ids, torch.zeros_like(ids)))

    draw(3)  # the one compile of each kernel
    torch.cuda.synchronize()
    stalls: dict = {}
    with host_stalls(stalls):
        for batch in (1, 2, 16, 17, 33, 64, 100, 128, 255, 256):
            draw(batch)
        torch.cuda.synchronize()
    count, ms, kernels = stalls["triton_compiles"]
    assert count == 0, f"{count} compiles ({ms} ms) after the first batch: {kernels}"
