"""Where the tokenizer services read the context window: config.json (top level, text_config),
tokenizer_config's model_max_length, transformers' default for sparse Gemma 3 configs, and a
clear error when nothing says it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from minisgl_tokenizer.model_files import ModelTokenizer

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"


def _model(tmp_path: Path, config: dict, model_max_length: float | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = json.loads((TINY / "tokenizer_config.json").read_text())
    tok.pop("model_max_length", None)
    if model_max_length is not None:
        tok["model_max_length"] = model_max_length
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_text_config_and_gemma3_defaults(tmp_path: Path) -> None:
    nested = _model(tmp_path / "a", {"text_config": {"max_position_embeddings": 4096}})
    assert ModelTokenizer.load(nested).max_model_len == 4096
    sparse = _model(tmp_path / "b", {"architectures": ["Gemma3ForConditionalGeneration"],
                                     "model_type": "gemma3",
                                     "text_config": {"model_type": "gemma3_text"}},
                    model_max_length=1e30)  # as Gemma's tokenizer_config says: no limit
    assert ModelTokenizer.load(sparse).max_model_len == 131072
    assert ModelTokenizer.load(sparse, max_model_len=8192).max_model_len == 8192


def test_unknown_context_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pass --max-model-len"):
        ModelTokenizer.load(_model(tmp_path, {"model_type": "something"}))
