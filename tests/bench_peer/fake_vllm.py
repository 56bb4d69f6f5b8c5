"""A stand-in for a vLLM site folder, for CPU tests of bench.peer: `vllm/__init__.py` whose `LLM`
records its keyword arguments, every generate call's prompts and max_tokens, and the NVLS and
sampler variables of its environment into $FAKE_VLLM_LOG (JSON lines), and answers each prompt
with max_tokens ids. It computes nothing: the tests check what the peer sends, not vLLM."""

from __future__ import annotations

from pathlib import Path

SOURCE = '''
import json, os
from types import SimpleNamespace

__version__ = "0.0-fake"
_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
        "VLLM_USE_FLASHINFER_SAMPLER", "PYTHONPATH")


def _log(rec):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(rec) + "\\n")


class SamplingParams:
    def __init__(self, temperature=1.0, ignore_eos=False, max_tokens=16):
        self.temperature, self.ignore_eos, self.max_tokens = temperature, ignore_eos, max_tokens


class LLM:
    def __init__(self, **kwargs):
        _log({"init": kwargs, "env": {k: os.environ.get(k) for k in _ENV}})
        sched = SimpleNamespace(max_num_batched_tokens=kwargs.get("max_num_batched_tokens", 8192))
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=sched),
                                          engine_core=SimpleNamespace(shutdown=lambda: None))

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        _log({"prompts": [p["prompt_token_ids"] for p in prompts],
              "max_tokens": [sp.max_tokens for sp in params]})
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], num_cached_tokens=0,
                                outputs=[SimpleNamespace(token_ids=[7] * sp.max_tokens)])
                for p, sp in zip(prompts, params)]
'''


def make_site(root: Path) -> Path:
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / "vllm" / "__init__.py").write_text(SOURCE)
    (root / "vllm-0.0.dist-info").mkdir(exist_ok=True)
    return root
