"""EngineConfig: everything the worker engine is started with. Each field is a flag of
`python -m minisgl_worker` (`FLAGS`: the service's sections), declared with minisgl_core.flags."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from minisgl_core.config import DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_METRICS_PORTS, DEFAULT_PORTS
from minisgl_core.flags import ServerFlags, ServiceFlags, flag

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "half": torch.float16, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp32": torch.float32, "float": torch.float32}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# KV cache element types besides "auto" (the activation dtype). fp8 halves the bytes each decode
# step reads; values are stored unscaled (scale 1.0, like vLLM/SGLang without checkpoint scales)
# and clamped to the type's finite range.
GPU_PAGE_SIZE, CPU_PAGE_SIZE = 64, 16  # KV tokens per page when page_size is not given
QUANTIZATIONS = ("none", "fp8")  # weight formats made from the loaded weights at start-up
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_saturation(dtype: torch.dtype) -> float:
    """The largest finite value of a one-byte (fp8) KV cache element, where stores clamp;
    0.0 for wider types, which are stored as cast."""
    return float(torch.finfo(dtype).max) if dtype.itemsize == 1 else 0.0


@dataclass
class EngineConfig:
    model_path: str = flag(help="HF model directory (config.json + *.safetensors)", option="--model")
    load_format: str = flag("auto", choices=LOAD_FORMATS, help=(
        "safetensors, or dummy: random weights from config.json (benchmarks)"))
    dtype: str = flag("auto", (
        "auto (float32 on CPU, bfloat16 on GPU), float16, bfloat16 or float32"))
    kv_cache_dtype: str = flag("auto", choices=("auto", *KV_CACHE_DTYPES), help=(
        "KV cache elements: auto (as --dtype), fp8_e4m3 or fp8_e5m2 (half the bytes, lossy; see "
        "docs/operations.md)"))
    quantization: str = flag("none", choices=QUANTIZATIONS, help=(  # fp8.py, quantize.py
        "none, or fp8: projections and MoE experts stored as fp8 e4m3 with a scale per row, "
        "made at start-up (half the weight bytes, lossy; see docs/operations.md)"))
    device: str = flag("auto", "auto, cpu, cuda or cuda:N")
    # None: 64 on a GPU (the Triton decode kernel then reads a whole page per 64-token block,
    # faster with an fp8 cache: docs/benchmarks/log/2026-11-23-07.md), 16 on CPU
    page_size: int | None = flag(None, (
        "tokens per KV page (default: 64 on a GPU, 16 on CPU)"))
    num_pages: int | None = flag(None, (
        "KV pages (default: GPU free memory x mem-fraction; CPU: kv-cache-tokens)"))
    window_pages: int | None = flag(None, (
        "pages of the sliding-window layers' KV pool (models whose windows are shorter than "
        "the context: Gemma 3, gpt-oss, Mistral v0.1); default: enough for every slot's window, "
        "a prefill chunk and as much again to keep finished requests' windows cached"))
    kv_cache_tokens: int = flag(16384, (
        "KV cache size in tokens on CPU when --num-pages is not given"))
    mem_fraction: float = flag(0.85, (
        "share of GPU memory for weights + KV cache"))
    max_slots: int = flag(256, (
        "requests the worker can hold at once (page-table rows)"))
    max_model_len: int | None = flag(None, (
        "context length (default: config.json max_position_embeddings)"))
    attention_backend: str = flag("auto", (
        "auto, torch, triton, flashinfer, fa3 or trtllm"))
    prefill_attention_backend: str | None = flag(None, (
        "backend for steps with prefill (hybrid mode)"))
    decode_attention_backend: str | None = flag(None, (
        "backend for decode-only steps (hybrid mode)"))
    cuda_graph_max_bs: int = flag(256, (
        "largest decode batch captured in a CUDA graph"))
    disable_cuda_graph: bool = flag(False, (
        "run every step eagerly (no decode graphs, no piecewise graphs)"))
    piecewise_max_tokens: int = flag(2048, (
        "CUDA graphs for prefill and mixed steps of up to this many tokens, captured in pieces "
        "between the attention calls (longer steps run eagerly; 0: all of them)"))
    disable_custom_all_reduce: bool = flag(False, (
        "TP: every all-reduce through NCCL, not the one-shot CUDA IPC kernel used for messages "
        "up to --custom-all-reduce-max-mb (512 KiB past 2 GPUs) when all GPUs have peer access"))
    custom_all_reduce_max_mb: int = flag(8, (
        "TP: the largest message (MiB) the custom all-reduce takes; larger ones (prefill "
        "chunks) go through NCCL. Each GPU holds 2 x tp_size x this in IPC buffers"))
    max_prefill_tokens: int | None = flag(None, (
        "TP: the scheduler's --max-prefill-tokens (default 8,192): sizes the two-shot "
        "all-reduce for steps of that many prompt tokens + max_slots (see "
        "--two-shot-max-tokens); give both services the same value"))
    two_shot_max_tokens: int | None = flag(None, (
        "TP: steps of up to this many tokens (default: --max-prefill-tokens + max_slots) sum "
        "their row-parallel outputs past --custom-all-reduce-max-mb with a two-shot CUDA IPC "
        "kernel fused with the residual add and RMSNorm instead of NCCL; 0: NCCL. Each GPU "
        "holds (tp_size - 1) x tokens x hidden size x 2 bytes (bf16) in an IPC buffer"))
    disable_sharded_sampling: bool = flag(False, (
        "TP: gather the full vocabulary's logits on every rank for every draw, instead of "
        "drawing greedy and temperature-only batches from each rank's shard and exchanging one "
        "(score, token) pair per row"))
    tp_size: int = flag(1, "tensor-parallel ranks (one GPU each)")
    tp_rank: int = flag(0, (
        "this process's rank (ranks > 0 need --dist-init-method)"))
    # None: rank 0 spawns the other ranks on this host
    dist_init_method: str | None = flag(None, (
        "torch.distributed rendezvous, e.g. tcp://10.0.0.1:29500"))
    dummy_seed: int = flag(0, "seed of the dummy weights")
    sampler_seed: int | None = flag(None, (
        "seed for requests without one (default: random)"))
    grammar_cache_mib: int = flag(256, (
        "host memory for compiled grammars (structured outputs), estimated; least recently used "
        "are dropped past it"))
    grammar_compile_timeout: float = flag(0.2, (
        "seconds from a grammar request's admission to its first mask; past it the request ends "
        "(EOS) rather than hold the batch (TP 1; at TP > 1 ranks wait for the bounded compile)"))
    # The flag is a JSON string; config_from_args (__main__) parses it.
    hf_overrides: dict[str, Any] = flag(
        default_factory=dict, help="JSON object merged into config.json, e.g. "
        "'{\"num_hidden_layers\": 2}'", kind=str, parser_default="{}")

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if (self.page_size is not None and self.page_size < 1) or self.max_slots < 1:
            raise ValueError("page_size and max_slots must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.window_pages is not None and self.window_pages < 1:
            raise ValueError("window_pages must be >= 1")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError("mem_fraction must be in (0, 1]")
        if not 1 <= self.custom_all_reduce_max_mb <= 1024:
            raise ValueError("custom_all_reduce_max_mb must be in [1, 1024] (MiB)")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.piecewise_max_tokens < 0:
            raise ValueError("piecewise_max_tokens must be >= 0")
        if self.two_shot_max_tokens is not None and self.two_shot_max_tokens < 0:
            raise ValueError("two_shot_max_tokens must be >= 0")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")

    def two_shot_step_tokens(self) -> int:
        """The largest step (tokens) the TP all-reduce's two-shot buffer covers (0: none):
        --two-shot-max-tokens, else the scheduler's prefill chunk and a full decode batch."""
        if self.two_shot_max_tokens is not None:
            return self.two_shot_max_tokens
        return (self.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS) + self.max_slots

    def torch_device(self) -> torch.device:
        if self.device == "auto" and not torch.cuda.is_available():
            return torch.device("cpu")
        dev = torch.device("cuda" if self.device == "auto" else self.device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("device=cuda asked for, but torch sees no CUDA device")
            if dev.index is None:  # one process per TP rank, one GPU each
                dev = torch.device("cuda", self.tp_rank % torch.cuda.device_count())
        return dev

    def resolved_page_size(self, device: torch.device) -> int:
        if self.page_size is not None:
            return self.page_size
        return GPU_PAGE_SIZE if device.type == "cuda" else CPU_PAGE_SIZE

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def torch_kv_dtype(self, device: torch.device) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype(device)
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


FLAGS = ServiceFlags(
    "worker", "minisgl worker: runs the model on the scheduler's step plans",
    (ServerFlags, EngineConfig),
    defaults={"port": DEFAULT_PORTS["worker"], "metrics_port": DEFAULT_METRICS_PORTS["worker"]},
)
