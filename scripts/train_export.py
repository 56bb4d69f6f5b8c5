"""Write the trained tiny model as a Hugging Face checkpoint laid out like Qwen3's on the Hub.

config.json uses the Hub's long-standing keys (top-level `rope_theta`, `torch_dtype`), which every
transformers version and our own loader read, rather than whatever the installed transformers
would serialise. Weights are bf16 safetensors with HF parameter names; the tied `lm_head.weight`
is left out, as `save_pretrained` does for tied checkpoints.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 704
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


def hub_config(shape: ModelShape, bos_id: int, eos_id: int, version: str) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_window_layers": shape.num_hidden_layers,
        "model_type": "qwen3",
        "rope_scaling": None,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": version,
        "use_cache": True,
        "use_sliding_window": False,
        **asdict(shape),
    }


def hf_model(shape: ModelShape, bos_id: int, eos_id: int) -> torch.nn.Module:
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**hub_config(shape, bos_id, eos_id, transformers.__version__))
    return Qwen3ForCausalLM(cfg)


def save_checkpoint(
    model: torch.nn.Module,
    shape: ModelShape,
    out_dir: Path,
    tokenizer_dir: Path,
    ids: dict[str, int],
) -> None:
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = hub_config(shape, ids["<|endoftext|>"], ids["<|im_end|>"], transformers.__version__)
    _write_json(out_dir / "config.json", cfg)
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
            "do_sample": True,
            "temperature": 0.7,
            "top_k": 40,
            "top_p": 0.9,
            # Greedy text of a model this small loops ("the God of Israel, the God of Israel");
            # a mild HF-style penalty keeps chat answers readable.
            "repetition_penalty": 1.1,
            "transformers_version": transformers.__version__,
        },
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).resolve() != (out_dir / name).resolve():
            shutil.copyfile(tokenizer_dir / name, out_dir / name)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
