"""Pre-quantized FP8 checkpoints (prequant.py, prequant_load.py): each on-disk layout written by
tests/worker/fp8_checkpoints.py from a tiny random Qwen3, loaded, and compared with HF
transformers holding the DEQUANTIZED weights in fp32.

Two compute paths are checked on CPU:
- the CPU default: fp8 weights dequantized at load into fp32, activations unquantized, so the
  logits are HF's within the usual fp32 tolerance (2e-4) and greedy tokens identical;
- the GPU formulas (weights kept fp8, activations quantized per token / 128-group / static
  scale), run here by their fp32 references: logits move by the activations' e4m3 rounding
  (a relative error of up to 2^-4 per element, ~1 % rms), measured below.
The block-scaled Triton GEMM is checked under the interpreter against the fp32 formula."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker import prequant_load
from minisgl_worker.engine import Engine, EngineConfig
from minisgl_worker.fp8_block import block_reference, dequantize_blocks, quantize_groups
from minisgl_worker.layers.fp8_linear import Fp8Linear
from minisgl_worker.layers.linear import RowParallelLinear
from minisgl_worker.model_config import ModelConfig

from .driver import run_requests
from .fp8_checkpoints import FORMATS, calibrate, write_fp8_checkpoint

VOCAB, PAGE = 512, 4
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(13)], [(11 * i + 5) % VOCAB for i in range(6)]]
# 192 wide: q/k/v and o read one whole and one partial 128-group; k and v (96 rows) are one
# partial block row, so q|k|v's block rows restart inside the packed weight; 320 = 2.5 groups.
SMALL = dict(hidden_size=192, head_dim=48, intermediate_size=320)
# TP=2: every row-parallel input (o: 256, down: 512) splits on a 128 boundary; k/v (128 rows)
# split inside a block row.
TP_SIZES = dict(hidden_size=256, head_dim=64, intermediate_size=512)
IGNORE = ["model.layers.1.mlp.down_proj"]  # stays unquantized (modules_to_not_convert etc.)


def _hf(sizes: dict, seed: int = 0):  # noqa: ANN202 - a transformers model
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Qwen3Config(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, **sizes)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """fmt -> (path, HF model with the dequantized weights, dequantized state dict)."""
    hf = _hf(SMALL)
    root = tmp_path_factory.mktemp("fp8")
    hf.save_pretrained(root / "bf16", safe_serialization=True)
    amax = calibrate(hf, PROMPTS)
    out = {}
    for fmt in FORMATS:
        ref = write_fp8_checkpoint(root / "bf16", root / fmt, fmt, IGNORE, amax)
        deq = _hf(SMALL)
        deq.load_state_dict(ref, strict=True)
        out[fmt] = (root / fmt, deq, ref)
    return out


def _engine(path: Path, **kw: object) -> Engine:
    return Engine(EngineConfig(model_path=str(path), page_size=PAGE, num_pages=64, max_slots=4,
                               **kw))  # type: ignore[arg-type]


def _logits(engine: Engine) -> torch.Tensor:
    reqs, page = [], 0
    for i, p in enumerate(PROMPTS):
        n = -(-len(p) // PAGE)
        reqs.append(ReqPlan(rid=i, slot=i, cache_len=0, input_ids=p,
                            new_pages=list(range(page, page + n)), sample=False))
        page += n
    return engine.forward_logits(StepPlan(0, reqs)).float()


def _hf_logits(hf) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([p])).logits[0].float() for p in PROMPTS])


def _keep_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load as on an fp8 GPU (weights kept fp8); the formulas then run their fp32 references."""
    from minisgl_worker import loader

    monkeypatch.setattr(loader, "keeps_fp8", lambda device, dtype: True)


def _fp8_layers(engine: Engine) -> dict[str, Fp8Linear]:
    return {n: m for n, m in engine.model.named_modules()
            if isinstance(m, Fp8Linear) and m.weight.dtype == torch.float8_e4m3fn}


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_on_cpu_equals_hf(checkpoints, fmt: str) -> None:  # noqa: ANN001
    """The CPU default path: the checkpoint's function exactly (dequantized fp32 weights)."""
    path, hf, _ = checkpoints[fmt]
    engine = _engine(path)
    assert engine.model_config.quant is not None
    assert not _fp8_layers(engine)  # dequantized at load on CPU
    ref = _hf_logits(hf)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(_logits(engine), ref, atol=2e-4, rtol=1e-4)
    got = run_requests(engine, PROMPTS, 8, PAGE)
    for p, tokens in zip(PROMPTS, got, strict=True):
        want = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert tokens == want
    engine.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_kept_fp8(checkpoints, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """quantize -> pack -> load with the weights kept fp8 (as on a GPU) -> dequantize from the
    engine's own fp8 bytes and scales: the reference weights bit for bit, packed q|k|v and
    gate|up included; the ignored projection stays unquantized."""
    path, _, ref = checkpoints[fmt]
    _keep_fp8(monkeypatch)
    engine = _engine(path)
    layers = _fp8_layers(engine)
    assert len(layers) == 2 * 4 - 1 and "model.layers.1.mlp.down_proj" not in layers
    for name, mod in layers.items():
        if mod.weight_block_scale is not None:
            assert fmt == "block"
            got = dequantize_blocks(mod.weight.data, mod.weight_block_scale.data)
        else:
            assert mod.weight_scale is not None and fmt != "block"
            got = mod.weight.data.float() * mod.weight_scale.data
            assert (mod.input_scale is not None) == (fmt in ("tensor", "ct_tensor"))
        parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                 "gate_up_proj": ["gate_proj", "up_proj"]}.get(name.rsplit(".", 1)[1])
        base = name.rsplit(".", 1)[0]
        want = torch.cat([ref[f"{base}.{p}.weight"] for p in parts]) if parts else \
            ref[name + ".weight"]
        assert torch.equal(got, want), name
    engine.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_kept_fp8_formulas_close_to_hf(checkpoints, fmt: str,  # noqa: ANN001
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU formulas with activation quantization, in fp32 torch, against HF's dequantized
    model: the weights are the same (round-trip test), so the logits differ by the activations'
    e4m3 rounding only: up to 2^-4 relative per element (~3.6 % rms) at the input of each of the
    14 quantized products, compounded by this random model (measured 0.087-0.094 for all four
    formats, 79-95 % greedy agreement; a wrong scale or layout gives ~1)."""
    path, hf, _ = checkpoints[fmt]
    _keep_fp8(monkeypatch)
    engine = _engine(path)
    ref, got = _hf_logits(hf), _logits(engine)
    err = ((got - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.15, err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.7
    engine.close()


@pytest.mark.parametrize("m, n, k", [(5, 40, 256), (16, 72, 320), (33, 130, 100)])
def test_block_gemm_kernel_equals_reference(m: int, n: int, k: int) -> None:
    """kernels/fp8_block_gemm.py under the interpreter: the fp32 formula with the same quantized
    operands, M/N edges masked, a short last K-group masked."""
    from minisgl_worker.kernels import fp8_block_gemm

    if type(fp8_block_gemm._fp8_block_gemm_kernel).__name__ != "InterpretedFunction":
        importlib.reload(fp8_block_gemm)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    qw, sw = quantize_groups(w)  # per-row group scales: the in-memory layout of block scales
    sw = sw * torch.rand(n, sw.shape[1], generator=gen).add(0.5)  # rows unlike their neighbours
    qx, sx = quantize_groups(x)
    want = block_reference(x, qw, sw)
    got = fp8_block_gemm.fp8_block_gemm(qx, qw, sx, sw, torch.float32, (16, 32, 4, 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tp2_block_fp8_equals_tp1(tmp_path: Path) -> None:
    """Block scales sharded with their rows (k/v split inside a block row) and K-groups (o,
    down): TP=2 over gloo gives TP=1's logits and tokens, and both HF's dequantized model's."""
    hf = _hf(TP_SIZES, seed=1)
    hf.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    ref = write_fp8_checkpoint(tmp_path / "bf16", tmp_path / "block", "block")
    hf.load_state_dict(ref, strict=True)
    out = {}
    for tp in (1, 2):
        engine = _engine(tmp_path / "block", tp_size=tp)
        out[tp] = (_logits(engine), run_requests(engine, PROMPTS, 6, PAGE))
        engine.close()
    torch.testing.assert_close(out[2][0], out[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1][0], _hf_logits(hf), atol=2e-4, rtol=1e-4)
    assert out[2][1] == out[1][1]


def test_tp_splitting_a_k_block_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl_worker.distributed import TPState
    from minisgl_worker.prequant import CheckpointQuant

    layer = RowParallelLinear(192, 64)
    layer.weight.data = layer.weight.data[:, :96]  # rank 0's half of 192 input features
    monkeypatch.setattr(prequant_load, "tp", lambda: TPState(rank=0, size=2))
    with pytest.raises(ValueError) as err:
        prequant_load._convert(layer, "model.layers.0.self_attn.o_proj",
                               CheckpointQuant("fp8", "block", False))
    msg = str(err.value)
    assert "tp_size=2" in msg and "o_proj" in msg and "128" in msg and "\n" not in msg


def _qwen3_cfg(qc: dict) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": VOCAB, "quantization_config": qc}


_CT = {"quant_method": "compressed-tensors", "format": "float-quantized"}


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "hqq", "bits": 4}, "quant_method='hqq'"),  # AWQ/GPTQ: test_prequant_w4
    ({"quant_method": "compressed-tensors", "format": "naive-quantized"},
     "format='naive-quantized'"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size=[64, 64]"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme='static'"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({"quant_method": "fp8", "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme="),
    ({**_CT, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme="),
    ({**_CT, "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "strategy": "channel"}, "input_activations": None}}},
     "config_groups.g.weights.num_bits=4"),
    ({**_CT, "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                              "strategy": "token"}}}},
     "config_groups.g.weights.strategy='group'"),
])
def test_unsupported_settings_are_refused_in_one_line(qc: dict, named: str) -> None:
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(_qwen3_cfg(qc))
    msg = str(err.value)
    assert named in msg and "quantization_config" in msg and "\n" not in msg, msg


def test_fp8_weight_without_scales_is_refused(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    """A quantized tensor the config does not account for (here: block fp8 weights under a
    compressed-tensors config, whose scale name differs) never loads as plain floats."""
    src, _, _ = checkpoints["block"]
    dst = shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = json.loads((checkpoints["ct_channel"][0] / "config.json")
                                            .read_text())["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        _engine(dst)
    msg = str(err.value)
    assert ("F8_E4M3" in msg or "weight_scale_inv" in msg) and "\n" not in msg, msg


def test_another_formats_moe_is_refused(tiny_model, tmp_path: Path) -> None:  # noqa: ANN001
    """fp8 experts load in the per-expert layout (test_prequant_fp8_moe.py); gpt-oss's stacked
    experts in fp8 with a scale of their own naming stop start-up, naming the tensor."""
    from safetensors.torch import load_file, save_file

    dst = shutil.copytree(tiny_model("gpt_oss"), tmp_path / "m")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    (f,) = dst.glob("*.safetensors")
    state = load_file(str(f))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    state[name] = state[name].to(torch.float8_e4m3fn)
    state[name + "_scale_inv"] = torch.ones(state[name].shape[0], 1, 1)
    save_file(state, str(f))
    with pytest.raises(ValueError) as err:
        _engine(dst)
    msg = str(err.value)
    assert "gate_up_proj" in msg and "\n" not in msg, msg


def test_start_up_memory_line_names_each_format() -> None:
    """The weight bytes by format (the loader's start-up line) name what the bytes hold."""
    from torch import nn

    m = nn.Module()
    for name, dtype in (("w13", torch.uint8), ("w13_scale", torch.uint8),
                        ("proj", torch.float8_e4m3fn), ("weight_scale_inv", torch.float32),
                        ("embed", torch.bfloat16), ("rows", torch.int8)):
        m.register_parameter(name, nn.Parameter(torch.zeros(1024, 256, dtype=dtype),
                                                requires_grad=False))
    line = prequant_load.bytes_by_format(m)
    for kind in ("mxfp4 weights", "mxfp4 scales (e8m0)", "fp8 e4m3", "quantization scales",
                 "bfloat16", "int8"):
        assert kind in line, line
