"""4-bit checkpoints (AWQ, GPTQ v1/v2 with and without act-order, compressed-tensors
pack-quantized symmetric / asymmetric / per channel: quant/w4_config.py, quant_load/w4*.py), each
written in its on-disk layout by tests/worker/w4_checkpoints.py from a tiny random model, loaded,
and compared with HF transformers holding the DEQUANTIZED weights in fp32.

On CPU the packed weights are dequantized at load into fp32, so the engine computes the
checkpoint's function exactly: logits within the fp32 tolerance and greedy tokens identical. The
round-trip test keeps the packed form (as on a GPU) and dequantizes the engine's own canonical
tensors: the reference weights bit for bit, q|k|v and gate|up parts included. The packed form also
runs on CPU through quant/w4a16.reference_linear (the kernels' oracle) and the experts' reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from minisgl_worker.engine import Engine
from minisgl_worker.layers.linear import RowParallelLinear
from minisgl_worker.model_config import ModelConfig
from minisgl_worker.quant.w4a16 import dequantize
from minisgl_worker.quant_load import w4
from safetensors.torch import save_file

from .driver import run_requests
from .test_prequant_fp8 import PAGE, PROMPTS, VOCAB, _engine, _hf_logits, _logits
from .tiny_models import COMMON, build_hf_model
from .w4_checkpoints import FORMATS, write_w4_checkpoint

SMALL = dict(hidden_size=64, head_dim=16, intermediate_size=128)  # K = 64 / 128: 2 / 4 groups of 32
WIDE = dict(hidden_size=128, head_dim=32, intermediate_size=256)  # groups of 128
IGNORE = ["model.layers.1.mlp.down_proj"]  # stays unquantized (modules_to_not_convert / ignore)
PARTS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _hf_qwen3(sizes: dict, seed: int = 0):  # noqa: ANN202 - a transformers model
    import transformers as tf

    from .tiny_models import randomize

    torch.manual_seed(seed)
    cfg = tf.Qwen3Config(**{**COMMON, **sizes}, tie_word_embeddings=False)
    return randomize(tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), seed)


def _write(root: Path, hf, fmt: str, group: int, ignore: list[str] = ()):  # noqa: ANN001, ANN202
    """(checkpoint path, HF model with the dequantized weights, dequantized state dict)."""
    import transformers as tf

    src = root / "src"
    if not src.exists():
        hf.save_pretrained(src, safe_serialization=True)
    ref = write_w4_checkpoint(src, root / f"{fmt}{group}", fmt, group, list(ignore))
    deq = shutil.copytree(src, root / f"{fmt}{group}-ref",
                          ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({k: v.contiguous() for k, v in ref.items()}, str(deq / "model.safetensors"),
              metadata={"format": "pt"})
    model = tf.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    return root / f"{fmt}{group}", model, ref


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root = tmp_path_factory.mktemp("w4")
    hf = _hf_qwen3(SMALL)
    return {fmt: _write(root, hf, fmt, 32, IGNORE) for fmt in FORMATS}





def _check_against_hf(engine: Engine, hf) -> None:  # noqa: ANN001
    ref = _hf_logits(hf)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(_logits(engine), ref, atol=2e-4, rtol=1e-4)
    got = run_requests(engine, PROMPTS, 8, PAGE)
    for p, tokens in zip(PROMPTS, got, strict=True):
        want = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert tokens == want


def _packed(engine: Engine) -> dict[str, w4.PackedW4Linear]:
    return {n: m.packed for n, m in engine.model.named_modules()
            if isinstance(getattr(m, "packed", None), w4.PackedW4Linear)}


def _keep_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(w4, "keeps_packed", lambda device, dtype: True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_on_cpu_equals_hf(checkpoints, fmt: str) -> None:  # noqa: ANN001
    path, hf, _ = checkpoints[fmt]
    engine = _engine(path)
    assert engine.model_config.quant is not None and engine.model_config.quant.scheme == "w4"
    assert not _packed(engine)  # dequantized at load on CPU
    _check_against_hf(engine, hf)
    engine.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_kept_packed(checkpoints, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """quantize -> pack -> load packed -> dequantize the engine's canonical tensors: the
    reference weights bit for bit; the ignored projection stays a plain weight."""
    path, _, ref = checkpoints[fmt]
    _keep_packed(monkeypatch)
    engine = _engine(path)
    layers = _packed(engine)
    assert len(layers) == 2 * 4 - 1 and "model.layers.1.mlp.down_proj" not in layers
    for name, packed in layers.items():
        w = packed.weight()
        assert (w.zeros is None) == (fmt in ("gptq_act", "ct_sym", "ct_channel")), name
        assert (w.perm is not None) == (fmt == "gptq_act"), name
        assert w.gidx is None
        base, kind = name.rsplit(".", 1)
        want = torch.cat([ref[f"{base}.{p}.weight"] for p in PARTS.get(kind, [kind])])
        assert torch.equal(dequantize(w), want), name
    engine.close()


def w4_bytes(engine: Engine) -> str:
    from minisgl_worker.prequant_load import bytes_by_format

    return bytes_by_format(engine.model)


@pytest.mark.parametrize("fmt", ["awq", "gptq_act", "ct_asym"])
def test_packed_reference_path_equals_dequantized(checkpoints, fmt: str,  # noqa: ANN001
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed form run on CPU (reference_linear, act-order perm included) gives the
    dequantized path's logits; the start-up memory line names the packed bytes."""
    path, _, _ = checkpoints[fmt]
    plain = _engine(path)
    want = _logits(plain)
    plain.close()
    _keep_packed(monkeypatch)
    engine = _engine(path)
    line = w4_bytes(engine)
    assert "int4 packed weights" in line and "int4 scales/zeros" in line, line
    torch.testing.assert_close(_logits(engine), want, atol=1e-5, rtol=1e-5)
    engine.close()


def test_group_128(tmp_path: Path) -> None:
    """Groups of 128 (K = 128 and 256), with act-order: the down projection's two groups are
    interleaved over its inputs."""
    path, hf, _ = _write(tmp_path, _hf_qwen3(WIDE, seed=2), "gptq_act", 128)
    engine = _engine(path)
    _check_against_hf(engine, hf)
    engine.close()


@pytest.mark.parametrize("fmt", ["awq", "gptq_act", "ct_asym"])
def test_tp2_equals_tp1(checkpoints, fmt: str) -> None:  # noqa: ANN001
    """TP=2 over gloo: column-parallel parts split along N (AWQ's qweight and the zero points
    packed along N), row-parallel along K; act-order row-parallel ranks hold rows of every group
    (gidx). Same logits and tokens as TP=1, and as HF's dequantized model."""
    path, hf, _ = checkpoints[fmt]
    out = {}
    for tp in (1, 2):
        engine = _engine(path, tp_size=tp)
        out[tp] = (_logits(engine), run_requests(engine, PROMPTS, 6, PAGE))
        engine.close()
    torch.testing.assert_close(out[2][0], out[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1][0], _hf_logits(hf), atol=2e-4, rtol=1e-4)
    assert out[2][1] == out[1][1]


def test_act_order_row_parallel_rank_uses_gidx(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """One rank of TP=2 built in-process: its act-order rows of o_proj / down_proj span every
    group, so it keeps all groups' scales and a gidx; dequantized, they are its columns of the
    reference weight."""
    from minisgl_worker.distributed import TPState

    path, _, ref = checkpoints["gptq_act"]
    monkeypatch.setattr(w4, "tp", lambda: TPState(rank=1, size=2))
    layer = RowParallelLinear(128, 64)
    layer.in_local = 64
    layer.weight.data = layer.weight.data[:, :64]
    from minisgl_worker.quant_load import w4_layouts
    from safetensors import safe_open

    cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    w4.convert_linear(layer, "model.layers.0.mlp.down_proj", cfg.quant.details, {  # type: ignore[union-attr]
        "qweight", "zeros", "scales", "g_idx"})
    assert layer.packed is not None and w4_layouts.SUFFIXES
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for suffix, attr in w4_layouts.SUFFIXES["gptq"].items():
            p = getattr(layer.packed, attr)
            p.weight_loader(p, f.get_slice("model.layers.0.mlp.down_proj" + suffix), None)
    layer.packed.finish()
    w = layer.packed.weight()
    assert w.gidx is not None and w.perm is not None and w.scales.shape[0] == 4
    torch.testing.assert_close(dequantize(w), ref["model.layers.0.mlp.down_proj.weight"][:, 64:],
                               atol=0, rtol=0)


def _moe(root: Path, fmt: str):  # noqa: ANN202
    hf = build_hf_model("qwen3_moe", seed=3)
    return _write(root, hf, fmt, 32)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct_asym"])
def test_qwen3_moe_w4_experts(tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-expert 4-bit tensors stacked on the block: dequantized at load on CPU equals HF's
    dequantized model; kept packed, the experts' reference path gives the same logits."""
    path, hf, _ = _moe(tmp_path, fmt)
    engine = _engine(path)
    block = engine.model.model.layers[0].mlp
    assert block.w13 is not None and block.w13.dtype == torch.float32
    _check_against_hf(engine, hf)
    want = _logits(engine)
    engine.close()
    _keep_packed(monkeypatch)
    engine = _engine(path)
    block = engine.model.model.layers[0].mlp
    assert block.w13 is None and block.w13_qweight.dtype == torch.int32
    assert "int4 packed weights" in w4_bytes(engine)
    torch.testing.assert_close(_logits(engine), want, atol=1e-5, rtol=1e-5)
    engine.close()


def _qwen3_cfg(qc: dict) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": VOCAB, "quantization_config": qc}


_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
_CT_W = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


def _ct(**weights: object) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {**_CT_W, **weights}, "input_activations": None}}}


@pytest.mark.parametrize("qc, named", [
    ({**_GPTQ, "bits": 3}, "bits=3"),
    ({**_AWQ, "bits": 8}, "bits=8"),
    ({**_GPTQ, "group_size": 256}, "group_size=256"),
    ({**_AWQ, "version": "gemv"}, "version='gemv'"),
    ({**_AWQ, "zero_point": False}, "zero_point=False"),
    ({**_GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({**_GPTQ, "bogus_key": 1}, "bogus_key=1"),
    ({**_GPTQ, "dynamic": {"-:.*down": {}}}, "dynamic="),
    (_ct(num_bits=8), "config_groups.g.weights.num_bits=8"),
    (_ct(actorder="bogus"), "config_groups.g.weights.actorder='bogus'"),
    (_ct(dynamic=True), "config_groups.g.weights.dynamic=True"),
    ({**_ct(), "config_groups": {"g": {"targets": ["Linear"], "weights": _CT_W,
                                       "input_activations": {"num_bits": 8}}}},
     "config_groups.g.input_activations="),
])
def test_unsupported_settings_are_refused_in_one_line(qc: dict, named: str) -> None:
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(_qwen3_cfg(qc))
    msg = str(err.value)
    assert named in msg and "quantization_config" in msg and "\n" not in msg, msg


def test_tp_splitting_a_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl_worker.distributed import TPState
    from minisgl_worker.quant.w4_config import W4Format

    layer = RowParallelLinear(192, 64)
    layer.in_local = 96
    layer.weight.data = layer.weight.data[:, :96]  # rank 0's half of 192 input features
    monkeypatch.setattr(w4, "tp", lambda: TPState(rank=0, size=2))
    with pytest.raises(ValueError) as err:
        w4.convert_linear(layer, "model.layers.0.self_attn.o_proj", W4Format("gptq", 64, True,
                                                                             False), {"qweight"})
    msg = str(err.value)
    assert "tp_size=2" in msg and "o_proj" in msg and "64" in msg and "\n" not in msg, msg


def test_act_order_experts_are_refused(tmp_path: Path) -> None:
    path, _, _ = _moe(tmp_path, "gptq_act")
    with pytest.raises(ValueError) as err:
        _engine(path)
    msg = str(err.value)
    assert "act-order" in msg and "\n" not in msg, msg


def test_parts_with_different_g_idx_are_refused(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    from safetensors.torch import load_file

    src, _, _ = checkpoints["gptq_act"]
    dst = shutil.copytree(src, tmp_path / "m")
    state = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        _engine(dst)
    msg = str(err.value)
    assert "qkv_proj" in msg and "g_idx" in msg and "\n" not in msg, msg
