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


def test_moe_kernels_compile_nothing_after_warm_up() -> None:
    """`fused_moe.warm_up` (run by the engine at start-up) compiles every tile config: no step
    size met later compiles a variant (Qwen3-30B-A3B offline on an H100 before it: 3 compiles,
    1.2 s, of the 257-1,024-token config in the timed run)."""
    from minisgl_worker.kernels.fused_moe import (
        fused_moe,
        moe_reference,
        quantize_experts,
        warm_up,
    )

    dev, num_experts, top_k, hidden, inter = torch.device("cuda"), 128, 8, 256, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=dev, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=dev, generator=gen) / inter**0.5
    q13, s13 = quantize_experts(w13)
    q2, s2 = quantize_experts(w2)
    bf13, bf2 = w13.bfloat16(), w2.bfloat16()
    for scales in ({}, {"w13_scale": s13, "w2_scale": s2}):
        a, b = (q13, q2) if scales else (bf13, bf2)
        assert warm_up(a, b, top_k, torch.bfloat16, **scales)
    torch.cuda.synchronize()

    stalls: dict = {}
    with host_stalls(stalls):
        for n in (2, 17, 32, 40, 100, 200, 256, 300, 700, 1024, 1500, 5000):
            x = torch.randn(n, hidden, device=dev, generator=gen).bfloat16()
            ids = torch.randint(0, num_experts, (n, top_k), device=dev, generator=gen)
            w = torch.full((n, top_k), 1.0 / top_k, device=dev, dtype=torch.bfloat16)
            out = fused_moe(x, bf13, bf2, ids, w)
            fused_moe(x, q13, q2, ids, w, w13_scale=s13, w2_scale=s2)
            if n in (40, 700):  # the kernels still compute the op
                ref = moe_reference(x.float(), w13, w2, ids, w.float())
                assert (out.float() - ref).norm() / ref.norm() < 2e-2
        torch.cuda.synchronize()
    count, ms, kernels = stalls["triton_compiles"]
    assert count == 0, f"{count} compiles ({ms} ms) after the warm-up: {kernels}"


def test_first_requests_compile_nothing_after_warm_up(tmp_path) -> None:
    """After the engine's start-up (graph capture and `warm_up_prefill`) the first requests
    compile no Triton kernel: greedy, with a temperature, with top-p or top-k and logprobs (the
    fp32 path of processors, penalties and logprobs), prompts under and over 32 tokens (the
    two tiles of the Triton prefill kernel), in batches of several widths. Before, the
    sampler's kernels compiled on each path's first batch, and the prefill kernel on the first
    batch whose page table's width fell in another class (1, a multiple of 16, other)."""
    from minisgl_core.sampling import SamplingParams
    from minisgl_worker.engine import Engine, EngineConfig
    from worker.driver import run_requests
    from worker.tiny_models import save_tiny

    path = save_tiny("qwen3", tmp_path / "qwen3")
    page = 64  # the GPU default: the warm-up prefills 8 and 64 tokens
    # (the tiny model's head_dim of 16 has no FlashInfer kernels)
    engine = Engine(EngineConfig(model_path=str(path), device="cuda", dtype="bfloat16",
                                 page_size=page, num_pages=256, max_slots=4, cuda_graph_max_bs=4,
                                 attention_backend="triton"))
    try:
        torch.cuda.synchronize()
        prompts = [[(7 * i + 3) % 512 for i in range(n)] for n in (9, 3, 40, 70)]
        stalls: dict = {}
        with host_stalls(stalls):
            for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
                           SamplingParams(temperature=0.8, top_p=0.5, seed=3),
                           SamplingParams(temperature=0.8, top_k=5, logprobs=True)):
                for batch in (prompts[:2], prompts[1:], prompts[3:]):
                    outs = run_requests(engine, batch, 6, page, params=params)
                    assert [len(o) for o in outs] == [6] * len(batch)
            torch.cuda.synchronize()
        count, ms, kernels = stalls["triton_compiles"]
        assert count == 0, f"{count} compiles ({ms} ms) after start-up: {kernels}"
    finally:
        engine.close()


def test_long_prompts_at_tp2_compile_nothing_after_start_up(tmp_path) -> None:
    """TP=2: a prefill step past the one-shot all-reduce's sizes takes the two-shot kernel
    (kernels/two_shot.py). The engine's start-up compiles it, and its row count is not
    specialised, so no long prompt compiles it again, whatever its length. Before, the first
    step over 8 MiB (1,025 tokens of Qwen3-8B) compiled it inside that request, and so did the
    first one whose length fell in the other class (a multiple of 16 or not). Here Qwen3-0.6B's
    shapes with a 1 MiB one-shot cap: steps over 512 tokens take the two-shot kernel."""
    if torch.cuda.device_count() < 2:
        import pytest

        pytest.skip("tensor parallelism needs 2 GPUs")
    from pathlib import Path

    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams

    from bench.common.model_dir import make

    root = Path(__file__).resolve().parents[2]
    model = make(str(root / "models" / "configs" / "Qwen3-0.6B"), str(tmp_path / "q06"))
    prompts = [[(7 * i + n) % 5000 for i in range(n)] for n in (600, 1024, 1500, 777)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    kw = dict(load_format="dummy", tp_size=2, max_model_len=4096, cuda_graph_max_bs=8,
              cache="naive")
    llm = LLM(str(model), custom_all_reduce_max_mb=1, **kw)
    try:
        stalls: dict = {}
        with host_stalls(stalls):
            outs = [llm.generate([p], greedy)[0]["token_ids"] for p in prompts]  # one a step
            torch.cuda.synchronize()
        count, ms, kernels = stalls["triton_compiles"]
        assert count == 0, f"{count} compiles ({ms} ms) after start-up: {kernels}"
    finally:
        llm.close()
    # The warm-up left the kernel's state as its peers expect: the same tokens as NCCL gives
    # (on two ranks both sum a pair of bf16 partials exactly once).
    with LLM(str(model), disable_custom_all_reduce=True, **kw) as nccl:
        assert [nccl.generate([p], greedy)[0]["token_ids"] for p in prompts] == outs
