"""Pre-quantized FP8 MoE checkpoints (quant_load/fp8_moe.py, fp8_mla.py): a tiny Qwen3-MoE and a
tiny DeepSeek-V3 (q LoRA, its latent projections fp8 too) written in the publishers' layouts by
tests/worker/fp8_checkpoints.py (its own block loops), loaded, and compared with HF transformers
holding the DEQUANTIZED weights in fp32; the block-scaled expert kernels
(kernels/moe_fp8_block.py) under the Triton interpreter against the fp32 formula.

Sizes make the blocks matter: hidden 192 (1.5 K-groups), moe_intermediate 160 (gate's block rows
end in a partial block, so up's rows start mid-block in the stacked w13; down's K is 1.25
groups), DeepSeek's kv_lora_rank 160 (kv_a rows 176 in two block rows, kv_b's K two groups)."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from minisgl_worker.engine import Engine
from minisgl_worker.fp8_block import quantize_groups
from minisgl_worker.layers.mla import deinterleave
from minisgl_worker.layers.moe import SparseMoeBlock
from minisgl_worker.quant.fp8_experts import dequantize_expert, moe_block_reference

from .driver import run_requests
from .fp8_checkpoints import MOE_FORMATS, quant_block, write_fp8_checkpoint
from .test_prequant_fp8 import PAGE, PROMPTS, _engine, _hf_logits, _keep_fp8, _logits
from .tiny_models import COMMON, DEEPSEEK, randomize

ARCHS = ("qwen3_moe", "deepseek_v3")
FP8 = torch.float8_e4m3fn


def _hf(arch: str, seed: int = 0, **sizes: int):  # noqa: ANN202 - a transformers model
    import transformers as tf

    torch.manual_seed(seed)
    base = {**COMMON, "hidden_size": 192, "intermediate_size": 256}
    if arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**{**base, "head_dim": 48, "moe_intermediate_size": 160,
                                   **sizes}, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    else:
        cfg = tf.DeepseekV3Config(
            **{**base, **DEEPSEEK, "kv_lora_rank": 160, "qk_nope_head_dim": 32,
               "qk_rope_head_dim": 16, "v_head_dim": 32, "moe_intermediate_size": 160},
            q_lora_rank=136, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
            topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return _scaled(randomize(model, seed))


def _scaled(model):  # noqa: ANN001, ANN202
    """randomize's 0.15 is for hidden 64; at 192 wide, 0.1 keeps the logits peaked, not saturated."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(0.1 / 0.15)
    return model


def _hf_dequantized(ref: dict[str, torch.Tensor], src: Path, dst: Path):  # noqa: ANN202
    """HF's model holding the dequantized weights: written per expert as the checkpoint is and
    read back by transformers (which stacks the experts its own way)."""
    import transformers as tf
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(ref, str(dst / "model.safetensors"), metadata={"format": "pt"})
    model = tf.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(arch, fmt) -> (path, HF model holding the dequantized weights, dequantized state)."""
    root = tmp_path_factory.mktemp("fp8moe")
    out = {}
    for arch in ARCHS:
        _hf(arch).save_pretrained(root / arch, safe_serialization=True)
        for fmt in MOE_FORMATS:
            ref = write_fp8_checkpoint(root / arch, root / f"{arch}-{fmt}", fmt)
            deq = _hf_dequantized(ref, root / arch, root / f"{arch}-{fmt}-deq")
            out[arch, fmt] = (root / f"{arch}-{fmt}", deq, ref)
    return out


def _moe_blocks(engine: Engine) -> dict[str, SparseMoeBlock]:
    return {n: m for n, m in engine.model.named_modules() if isinstance(m, SparseMoeBlock)}


@pytest.mark.parametrize("fmt", MOE_FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_dequantized_on_cpu_equals_hf(checkpoints, arch: str, fmt: str) -> None:  # noqa: ANN001
    """The CPU default: experts, shared experts and latent projections dequantized at load, the
    checkpoint's function exactly: HF's logits within fp32 tolerance, greedy tokens identical."""
    path, hf, _ = checkpoints[arch, fmt]
    engine = _engine(path)
    assert all(b.w13.dtype == torch.float32 and b.w13_scale is None
               for b in _moe_blocks(engine).values())
    ref = _hf_logits(hf)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(_logits(engine), ref, atol=2e-4, rtol=1e-4)
    got = run_requests(engine, PROMPTS, 8, PAGE)
    for p, tokens in zip(PROMPTS, got, strict=True):
        want = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert tokens == want
    engine.close()


def _permuted(ref: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    """The checkpoint rows in the order the engine holds them (mla.py's rotary permutation)."""
    blocks = ref.clone().view(-1, head_dim, ref.shape[1])
    rope = blocks[:, head_dim - rope_dim:]
    rope.copy_(rope[:, deinterleave(rope_dim)].clone())
    return blocks.view_as(ref)


@pytest.mark.parametrize("fmt", ["block", "ct_channel"])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_kept_fp8(checkpoints, arch: str, fmt: str,  # noqa: ANN001
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """quantize -> pack -> load kept fp8 (as on a GPU) -> dequantize the engine's own bytes and
    scales: every expert (gate|up stacked) the reference weights bit for bit; DeepSeek's
    replicated projections fp8 with their rows' scales (the rotary rows permuted alike) and
    kv_b_proj dequantized at load, exactly."""
    from minisgl_worker.fp8_block import dequantize_blocks

    path, _, ref = checkpoints[arch, fmt]
    _keep_fp8(monkeypatch)
    engine = _engine(path)
    blocks = _moe_blocks(engine)
    assert blocks
    for name, b in blocks.items():
        assert b.w13.dtype == FP8 and b.w2.dtype == FP8
        assert isinstance(b.w13_scale, torch.Tensor) and isinstance(b.w2_scale, torch.Tensor)
        assert b.w13_scale.dim() == (3 if fmt == "block" else 2)
        for e in range(b.num_experts):
            pre = f"{name}.experts.{e}"
            if fmt == "block":
                w13 = dequantize_expert(b.w13.data[e], b.w13_scale[e], 2)
                w2 = dequantize_expert(b.w2.data[e], b.w2_scale[e], 1)
            else:
                w13 = b.w13.data[e].float() * b.w13_scale[e, :, None]
                w2 = b.w2.data[e].float() * b.w2_scale[e, :, None]
            assert torch.equal(w13, torch.cat([ref[f"{pre}.gate_proj.weight"],
                                               ref[f"{pre}.up_proj.weight"]]))
            assert torch.equal(w2, ref[f"{pre}.down_proj.weight"])
    if arch == "deepseek_v3":
        attn = engine.model.model.layers[1].self_attn
        kv = ref["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
        for mod, want in ((attn.q_a_proj, ref["model.layers.1.self_attn.q_a_proj.weight"]),
                          (attn.kv_a_proj_with_mqa, _permuted(kv, kv.shape[0], 16))):
            assert mod.weight.dtype == FP8
            got = dequantize_blocks(mod.weight.data, mod.weight_block_scale) \
                if fmt == "block" else mod.weight.data.float() * mod.weight_scale
            assert torch.equal(got, want)
        assert attn.kv_b_proj.weight.dtype == torch.float32
        assert torch.equal(attn.kv_b_proj.weight, ref["model.layers.1.self_attn.kv_b_proj.weight"])
    engine.close()


@pytest.mark.parametrize("fmt", ["block", "ct_channel"])
@pytest.mark.parametrize("arch", ARCHS)
def test_kept_fp8_formulas_close_to_hf(checkpoints, arch: str, fmt: str,  # noqa: ANN001
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU formulas (activations quantized per token and group / per row) in fp32 torch
    against HF's dequantized model: the weights are equal (round trip), so the logits move by
    the activations' e4m3 rounding only (2^-4 relative per element at each quantized product's
    input, compounded over the layers). Measured: Qwen3-MoE 0.076-0.083, DeepSeek-V3 0.118-0.129
    (more quantized products a layer: q_a, q_b, kv_a, o, experts, shared experts), 84-89 %
    greedy agreement; a wrong scale or layout gives ~1."""
    path, hf, _ = checkpoints[arch, fmt]
    _keep_fp8(monkeypatch)
    engine = _engine(path)
    ref, got = _hf_logits(hf), _logits(engine)
    err = ((got - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.2, err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.7
    engine.close()


def test_tp2_block_experts_equal_tp1(tmp_path: Path) -> None:
    """Each rank takes whole 128-blocks of every expert's intermediate dimension (256 -> 128 a
    rank) with their scales: TP=2 over gloo gives TP=1's logits and tokens, and HF's."""
    hf = _hf("qwen3_moe", seed=1, head_dim=64, moe_intermediate_size=256)
    hf.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    ref = write_fp8_checkpoint(tmp_path / "bf16", tmp_path / "block", "block")
    hf = _hf_dequantized(ref, tmp_path / "bf16", tmp_path / "deq")
    out = {}
    for tp in (1, 2):
        engine = _engine(tmp_path / "block", tp_size=tp)
        out[tp] = (_logits(engine), run_requests(engine, PROMPTS, 6, PAGE))
        engine.close()
    torch.testing.assert_close(out[2][0], out[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1][0], _hf_logits(hf), atol=2e-4, rtol=1e-4)
    assert out[2][1] == out[1][1]


def test_tp_cutting_an_expert_block_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl_worker.distributed import TPState
    from minisgl_worker.prequant import CheckpointQuant
    from minisgl_worker.quant_load import fp8_moe

    block = SparseMoeBlock(64, 128, 4, 2, True)
    block.w13.data = block.w13.data[:, :128]  # rank 0's gate|up rows of 128 at tp 2
    monkeypatch.setattr(fp8_moe, "tp", lambda: TPState(rank=0, size=2))
    with pytest.raises(ValueError) as err:
        fp8_moe.convert(block, "model.layers.0.mlp", CheckpointQuant("fp8", "block", False))
    msg = str(err.value)
    assert "tp_size=2" in msg and "moe_intermediate_size 128" in msg and "64 per rank" in msg
    assert "model.layers.0.mlp" in msg and "\n" not in msg


def test_static_expert_activations_are_refused(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    path = tmp_path / "static"
    write_fp8_checkpoint(checkpoints["qwen3_moe", "block"][0].parent / "qwen3_moe", path,
                         "tensor")
    with pytest.raises(ValueError) as err:
        _engine(path)
    msg = str(err.value)
    assert "static activation scales" in msg and "experts" in msg and "\n" not in msg


def test_expert_scales_without_fp8_weights_are_refused(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    """An expert whose scale arrives beside an unquantized weight never loads as plain floats."""
    from safetensors.torch import load_file, save_file

    src = checkpoints["qwen3_moe", "block"][0]
    dst = shutil.copytree(src, tmp_path / "m")
    state = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    state[name] = state[name].float()
    save_file(state, str(dst / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        _engine(dst)
    msg = str(err.value)
    assert name in msg and "fp8" in msg and "\n" not in msg
    assert json.loads((dst / "config.json").read_text())["quantization_config"]


# ------------------------------------------------------------------------------------------------
# The kernels, under the Triton interpreter
# ------------------------------------------------------------------------------------------------


def _kernels():  # noqa: ANN202 - the module, its kernels interpreted
    from minisgl_worker.kernels import moe_fp8_block, moe_fp8_block_kernels

    if type(moe_fp8_block_kernels.gate_up_kernel).__name__ != "InterpretedFunction":
        importlib.reload(moe_fp8_block_kernels)
    return moe_fp8_block


def _block_experts(e: int, n: int, k: int, parts: int, gen: torch.Generator):
    """Random experts quantized by fp8_checkpoints' block loop, each part (gate, up) its own
    blocks; the scales scattered so neighbouring blocks differ."""
    w = torch.randn(e, n, k, generator=gen) * 0.05
    q = torch.empty(e, n, k, dtype=FP8)
    scales = []
    for i in range(e):
        rows = []
        for part in w[i].chunk(parts):
            qp, sp, _ = quant_block(part * torch.rand(part.shape[0], 1, generator=gen).add(0.5))
            rows.append((qp, sp))
        q[i] = torch.cat([r[0] for r in rows])
        scales.append(torch.cat([r[1] for r in rows]))
    return q, torch.stack(scales)


@pytest.mark.parametrize("t, e, h, inter, top_k", [(7, 4, 200, 160, 2), (5, 8, 256, 128, 3)])
@pytest.mark.parametrize("swap", [False, True])
def test_block_experts_kernel_equals_reference(t: int, e: int, h: int, inter: int, top_k: int,
                                               swap: bool) -> None:
    """The grouped GEMMs (both tile orientations, short K-groups masked, partial N tiles, the
    single- and many-program alignment) against quant/fp8_experts.py's fp32 formula of the same
    fp8 operands."""
    from minisgl_worker.kernels.fused_moe import GemmTile, MoeConfig

    mod = _kernels()
    gen = torch.Generator().manual_seed(t)
    q13, s13 = _block_experts(e, 2 * inter, h, 2, gen)
    q2, s2 = _block_experts(e, h, inter, 1, gen)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    weights = torch.rand(t, top_k, generator=gen)
    want = moe_block_reference(x, q13, q2, ids, weights, s13, s2)
    assert want.abs().max() > 0.1
    for block_k, single in ((64, 256), (128, 0)):
        cfg = MoeConfig(16, GemmTile(32, block_k, swap_ab=swap), GemmTile(64, block_k, swap_ab=swap))
        got = mod.fused_moe_fp8_block(x, q13, q2, ids, weights, s13, s2, config=cfg,
                                      single_align_max_pairs=single)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_group_quantization_kernel_equals_torch() -> None:
    """The per-token-group quantization kernel: fp8_block.quantize_groups's scales, and its
    values before rounding (the interpreter's fp32 -> fp8 cast does not round to nearest),
    rounded by torch: the same fp8 bytes."""
    mod = _kernels()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 600, generator=gen) * torch.rand(5, 1, generator=gen) * 10
    x[2, 128:256] = 0.0  # an all-zero group
    q, s = mod.quantize_token_groups(x, torch.float32)
    q_ref, s_ref = quantize_groups(x)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    torch.testing.assert_close(q.to(FP8).float(), q_ref.float(), rtol=0, atol=0)
    assert q.abs().max() <= 448.0
