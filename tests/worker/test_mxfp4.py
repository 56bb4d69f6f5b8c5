"""gpt-oss MXFP4 checkpoints (quant/mxfp4.py, quant_load/mxfp4.py, kernels/moe_mxfp4.py): a tiny
gpt-oss written in OpenAI's on-disk layout by tests/worker/mxfp4_checkpoints.py (its own
encoder), checked against HF transformers holding the dequantized experts in fp32, and against
transformers' own MXFP4 loader (which pins the writer's layout independently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker.engine import Engine, EngineConfig
from minisgl_worker.layers.gpt_oss_moe import GptOssMoeBlock
from minisgl_worker.model_config import ModelConfig
from minisgl_worker.quant import mxfp4
from minisgl_worker.quant_load import mxfp4 as mxfp4_load

from .driver import run_requests, with_window_pages
from .mxfp4_checkpoints import encode_rows, write_mxfp4_checkpoint
from .tiny_models import COMMON, GPT_OSS, randomize

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4
PROMPTS = [[(7 * i + 3) % 512 for i in range(13)], [(11 * i + 5) % 512 for i in range(6)]]


def _hf(inter: int = 32, seed: int = 0):  # noqa: ANN202 - a transformers model
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GptOssConfig(**{**COMMON, **GPT_OSS, "intermediate_size": inter})
    return randomize(tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), seed)


def _checkpoint(root: Path, inter: int = 32, bf16_layers: tuple[int, ...] = ()):  # noqa: ANN202
    """(path, HF model holding the dequantized weights, their state dict)."""
    hf = _hf(inter)
    hf.save_pretrained(root / "src", safe_serialization=True)
    ref = write_mxfp4_checkpoint(root / "src", root / "mx", bf16_layers)
    hf.load_state_dict(ref, strict=True)
    return root / "mx", hf, ref


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return _checkpoint(tmp_path_factory.mktemp("mxfp4"), bf16_layers=(1,))


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
    return engine.forward_logits(with_window_pages(engine, StepPlan(0, reqs))).float()


def _hf_logits(hf) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([p])).logits[0].float() for p in PROMPTS])


def _greedy(hf, n: int) -> list[list[int]]:  # noqa: ANN001
    return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def _blocks(engine: Engine) -> list[GptOssMoeBlock]:
    return [m for m in engine.model.modules() if isinstance(m, GptOssMoeBlock)]


def test_writer_layout_is_transformers_mxfp4(ckpt) -> None:  # noqa: ANN001
    """transformers' own MXFP4 loader (dequantize=True) reads the test checkpoint into exactly
    the writer's dequantized weights: the writer's layout is the ecosystem's."""
    import transformers as tf

    path, _, ref = ckpt
    hf = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=tf.Mxfp4Config(dequantize=True))
    state = hf.state_dict()
    assert ref.keys() <= state.keys()
    for name, want in ref.items():
        assert torch.equal(state[name].float(), want), name


def test_dequantized_on_cpu_equals_hf(ckpt) -> None:  # noqa: ANN001
    """The CPU default: experts dequantized at load (layer 1 stored bf16 as the config lists):
    logits within fp32 tolerance of HF's, greedy tokens identical."""
    path, hf, _ = ckpt
    engine = _engine(path)
    assert engine.model_config.quant is not None
    assert engine.model_config.quant.scheme == "mxfp4"
    assert all(b.w13.dtype == torch.float32 and b.w13_scale is None for b in _blocks(engine))
    ref = _hf_logits(hf)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(_logits(engine), ref, atol=2e-4, rtol=1e-4)
    assert run_requests(engine, PROMPTS, 8, PAGE) == _greedy(hf, 8)
    engine.close()


def test_packed_round_trip_and_reference(ckpt, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Kept packed (as on a GPU): the engine's bytes dequantize to the writer's weights bit for bit
    (gate/up de-interleaved, down as rows), the bf16 layer stays bf16, and the packed experts'
    reference computes HF's logits."""
    path, hf, ref = ckpt
    monkeypatch.setattr(mxfp4_load, "KEEP_PACKED_ON_CPU", True)
    engine = _engine(path)
    packed, plain = _blocks(engine)
    assert packed.w13.dtype == torch.uint8 and plain.w13.dtype == torch.float32
    assert packed.w13_scale is not None and packed.w2_scale is not None
    gate_up = ref["model.layers.0.mlp.experts.gate_up_proj"]  # [E, H, 2I], interleaved
    want13 = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], -1).transpose(1, 2)
    want2 = ref["model.layers.0.mlp.experts.down_proj"].transpose(1, 2)
    assert torch.equal(mxfp4.dequantize(packed.w13, packed.w13_scale), want13)
    assert torch.equal(mxfp4.dequantize(packed.w2, packed.w2_scale), want2)
    torch.testing.assert_close(_logits(engine), _hf_logits(hf), atol=2e-4, rtol=1e-4)
    engine.close()


def test_quantize_pack_dequantize_round_trip() -> None:
    """The engine's quantizer and packer against the test writer's own loops: same bytes, same
    scales; dequantize gives the writer's values; requantizing those is the identity."""
    w = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(3))
    w[0, 0, :32] = 0.0  # an all-zero block
    blocks, scales, decoded = encode_rows(w)
    q, s = mxfp4.quantize(w)
    assert torch.equal(q, blocks) and torch.equal(s, scales)
    assert torch.equal(mxfp4.dequantize(q, s), decoded)
    assert torch.equal(mxfp4.quantize(decoded)[0], q)
    assert mxfp4.e2m1_values().tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_tp2_equals_tp1(tmp_path: Path) -> None:
    """I = 64: each of 2 ranks takes 32 intermediate columns (one 32-block of down's K): TP=2
    over gloo gives TP=1's logits and tokens, and HF's."""
    path, hf, _ = _checkpoint(tmp_path, inter=64)
    out = {}
    for tp in (1, 2):
        engine = _engine(path, tp_size=tp)
        out[tp] = (_logits(engine), run_requests(engine, PROMPTS, 6, PAGE))
        engine.close()
    torch.testing.assert_close(out[2][0], out[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1][0], _hf_logits(hf), atol=2e-4, rtol=1e-4)
    assert out[2][1] == out[1][1] == _greedy(hf, 6)


def test_tp_splitting_a_block_is_refused(ckpt) -> None:  # noqa: ANN001
    """I = 32 at tp=2: 16 intermediate columns a rank would cut down's 32-blocks."""
    with pytest.raises(ValueError) as err:
        _engine(ckpt[0], tp_size=2)
    msg = str(err.value)
    assert "tp_size=2" in msg and "intermediate_size=32" in msg and "32-wide MXFP4 block" in msg
    assert "\n" not in msg


def _config(qc: dict) -> dict:
    d = json.loads((ROOT / "models/configs/gpt-oss-20b/config.json").read_text())
    d["quantization_config"] = qc
    return d


def test_openai_config_parses() -> None:
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    quant = ModelConfig.from_dict(_config(qc)).quant
    assert quant is not None and quant.method == quant.scheme == "mxfp4"
    assert quant.ignored == tuple(qc["modules_to_not_convert"])
    assert "e2m1" in quant.describe()


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "mxfp4", "group_size": 64}, "group_size=64"),
    ({"quant_method": "mxfp4", "dequantize": True}, "dequantize=True"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"},
     "modules_to_not_convert='lm_head'"),
])
def test_unknown_settings_are_refused_in_one_line(qc: dict, named: str) -> None:
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(_config(qc))
    msg = str(err.value)
    assert named in msg and "quantization_config" in msg and "\n" not in msg, msg
