"""A checkpoint the engine cannot read in full stops start-up with one line naming what it does not
understand: a publisher's `quantization_config` other than the FP8 formats that load (prequant.py),
or a tensor that matches no parameter. Before, an FP8 or compressed-tensors checkpoint loaded with
a warning per tensor and answered garbage; FP8 ones now load (tests/worker/test_prequant_fp8.py
has the formats against HF; here: the embedded model, end to end)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import TINY_MODEL


def _copy_tiny(dst: Path) -> Path:
    shutil.copytree(TINY_MODEL, dst)
    return dst


def _with_quantization(dst: Path, qc: dict) -> Path:
    model = _copy_tiny(dst)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = qc
    (model / "config.json").write_text(json.dumps(cfg))
    return model


def _with_extra_tensor(dst: Path, name: str) -> Path:
    model = _copy_tiny(dst)
    save_file({name: torch.ones(4, 4)}, str(model / "extra.safetensors"))
    return model


def _llm_error(model: Path) -> str:
    from minisgl import LLM

    with pytest.raises(ValueError) as err:
        LLM(str(model))
    return str(err.value)


@pytest.mark.parametrize("qc, named", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]},
     "weight_block_size=[64, 64]"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized"},
     "format='naive-quantized'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False}, "bits=3"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
])
def test_quantization_config_is_refused(tmp_path: Path, qc: dict, named: str) -> None:
    msg = _llm_error(_with_quantization(tmp_path / "m", qc))
    assert named in msg and "is not supported" in msg and "\n" not in msg


@pytest.mark.parametrize("fmt", ["block", "ct_channel"])
def test_fp8_checkpoints_load(tmp_path: Path, fmt: str) -> None:
    """The embedded model quantized in a publisher's FP8 layout loads and answers exactly as the
    same model holding the dequantized weights (CPU dequantizes at load)."""
    from minisgl import LLM
    from minisgl_core.sampling import SamplingParams

    from tests.worker.fp8_checkpoints import write_fp8_checkpoint

    ref = write_fp8_checkpoint(TINY_MODEL, tmp_path / "fp8", fmt)
    plain = Path(shutil.copytree(TINY_MODEL, tmp_path / "deq",
                                 ignore=shutil.ignore_patterns("*.safetensors")))
    save_file(ref, str(plain / "model.safetensors"), metadata={"format": "pt"})
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["Once upon a time", "The capital of"]
    out = {}
    for name in ("fp8", "deq"):
        llm = LLM(str(tmp_path / name))
        out[name] = [r["token_ids"] for r in llm.generate(prompts, greedy)]
        llm.close()
    assert out["fp8"] == out["deq"] and all(len(t) == 12 for t in out["fp8"])


def test_unmatched_checkpoint_tensor_is_refused(tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    msg = _llm_error(_with_extra_tensor(tmp_path / "m", name))
    assert repr(name) in msg and "not all loaded" in msg


def test_worker_process_exits_with_one_line(tmp_path: Path) -> None:
    model = _with_quantization(tmp_path / "m", {"quant_method": "hqq", "bits": 4})
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINISGL_WORKER")}
    out = subprocess.run(
        [sys.executable, "-m", "minisgl_worker", "--model", str(model), "--port", "0",
         "--metrics-port", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "quant_method='hqq' is not supported" in text and "Traceback" not in text, text
