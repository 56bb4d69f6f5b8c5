"""vLLM's in-process `LLM`, configured like the project's benchmarks configure theirs: dummy
weights from a config.json folder (or the folder's checkpoint, --load-format safetensors), no
tokenizer (prompts are token ids), prefix caching on, 256 sequences at most, vLLM's neutral
sampling defaults (no generation_config.json read)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="folder with a config.json (the same path ours ran on, so the rows "
                             "match in bench.peer.compare)")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--load-format", default="dummy",
                        help="dummy (random weights from config.json) or safetensors (the "
                             "folder's checkpoint: a pre-quantized one loads in its own format)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    parser.add_argument("--quantization", default="none", choices=["none", "fp8"])
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no torch.compile, no CUDA graphs")
    parser.add_argument("--attention-backend", default=None,
                        help="e.g. FLASH_ATTN (default: vLLM's choice; FA3 on Hopper)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="vLLM's tokens per step (its chunked-prefill budget); default: its own")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)


def engine_kwargs(args: argparse.Namespace, max_model_len: int,
                  enable_prefix_caching: bool = True) -> dict[str, Any]:
    """LLM(...) keyword arguments; also the source of the OpenAI server's flags."""
    kwargs: dict[str, Any] = dict(
        model=str(Path(args.model).resolve()), load_format=args.load_format,
        skip_tokenizer_init=True,
        max_num_seqs=256, max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization, generation_config="vllm",
        kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager, seed=0,
        tensor_parallel_size=args.tp)
    if args.quantization != "none":
        kwargs["quantization"] = args.quantization
    if args.attention_backend:
        kwargs["attention_config"] = {"backend": args.attention_backend}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kwargs


def base_record(version: str, args: argparse.Namespace, bench: str,
                engine_env: dict[str, str] | None = None) -> dict[str, Any]:
    """The keys every peer line shares (named as in ours, for bench.peer.compare).
    `engine_env`: the environment vLLM ran in when it ran in a child process (the server)."""
    from bench.peer.vllm_env import device_name, flashinfer_visible

    return {"bench": bench, "engine": "vllm", "version": version,
            "model": Path(args.model).name, "tp": args.tp, "device": device_name(),
            "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
            "load_format": args.load_format,
            "cuda_graph": not args.enforce_eager,
            "flashinfer_on_path": flashinfer_visible(engine_env)}


def make_llm(args: argparse.Namespace, max_model_len: int, **overrides: Any) -> Any:
    from vllm import LLM

    return LLM(**{**engine_kwargs(args, max_model_len), **overrides})
