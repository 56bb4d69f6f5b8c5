"""Attention backends by name, and the hybrid that splits prefill and decode steps.

    create_backend("torch", config, pool)
    create_backend("auto", config, pool, prefill="fa3", decode="flashinfer")   # hybrid

A name that is unknown, not built, unable to run on this device, or without a kernel for a
feature the model's layers need (`LayerAttention`: windows, soft-caps, sinks) raises
`BackendUnavailable` at start-up: never a silent fallback to another backend. Only "auto" chooses,
and it chooses a backend that can serve every layer.
"""

from __future__ import annotations

import importlib

import torch

from .. import env
from .base import (
    PLAIN,
    AttentionBackend,
    AttentionConfig,
    BackendUnavailable,
    ForwardBatch,
    LayerAttention,
)
from .kv_pool import KVPool

# name -> (module under this package, class, needs a CUDA device)
_REGISTRY: dict[str, tuple[str, str, bool]] = {
    "torch": ("torch_backend", "TorchBackend", False),
    "triton": ("triton_backend", "TritonBackend", True),
    "flashinfer": ("flashinfer_backend", "FlashInferBackend", True),
    "fa3": ("flashinfer_backend", "FA3Backend", True),  # FlashInfer's FA3 prefill kernels
    "trtllm": ("flashinfer_backend", "TrtllmBackend", True),
}
BACKEND_NAMES = ("auto", *_REGISTRY)


def resolve_name(name: str, device: torch.device) -> str:
    """'auto' -> a concrete name for `device`: torch on CPU, flashinfer on CUDA when the package
    is installed, triton otherwise."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    try:
        importlib.import_module("flashinfer")
        return "flashinfer"
    except ImportError:
        return "triton"


def backend_class(name: str, device: torch.device) -> type[AttentionBackend]:
    if name not in _REGISTRY:
        raise BackendUnavailable(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    module, cls_name, needs_cuda = _REGISTRY[name]
    interpreted = name == "triton" and env.SETTINGS.triton_interpret
    if needs_cuda and device.type != "cuda" and not interpreted:
        raise BackendUnavailable(
            f"attention backend {name!r} needs a CUDA device, but the worker runs on "
            f"{device.type!r}; use --attention-backend torch (or auto) on CPU")
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        raise BackendUnavailable(
            f"attention backend {name!r} is not available in this build ({exc})") from exc
    cls: type[AttentionBackend] = getattr(mod, cls_name)
    cls.check_available(device)
    return cls


class HybridBackend(AttentionBackend):
    """Decode-only steps go to `decode`, every other step to `prefill`; one shared KV pool."""

    name = "hybrid"

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        super().__init__(prefill.config, prefill.pool)
        self.prefill, self.decode = prefill, decode
        # A ClassVar elsewhere; the composite backend takes its decode half's answer per instance.
        self.supports_cuda_graph = decode.supports_cuda_graph  # type: ignore[misc]
        self._active: AttentionBackend = prefill

    def prepare(self, batch: ForwardBatch) -> None:
        self._active = self.decode if batch.is_decode else self.prefill
        self._active.prepare(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return self._active.forward(q, k, v, layer_id, kv_stored=kv_stored, sinks=sinks)

    def store_loc(self) -> torch.Tensor | None:
        return self._active.store_loc()

    def init_cuda_graph(self, max_bs: int) -> None:
        self.decode.init_cuda_graph(max_bs)

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        self._active = self.decode
        self.decode.prepare_for_capture(batch)

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        self._active = self.decode
        self.decode.prepare_for_replay(batch)


def auto_decode_name(base: str) -> str:
    """What 'auto' decodes with: `base`, except that where FlashInfer was the pick our Triton
    split-K kernel decodes. Per layer on an H100 (one decode step's attention timed alone, ~1k
    contexts) it is within 1-3 % of FlashInfer's tensor-core decode at batch 64-256 with a bf16
    cache, 1.7x faster at batch 16, faster than its CUDA-core decode everywhere, and ~15 % faster
    over an fp8 cache (FlashInfer's fp8 decode is compute-bound); bs=1 Qwen3-8B 167.7 vs 163.7
    tok/s. FlashInfer still prefills."""
    return "triton" if base == "flashinfer" else base


# What FlashInfer's FA3 kernels are built for (FA3Backend refuses the rest at start-up).
_FA3_DTYPES = (torch.float16, torch.bfloat16)
_FA3_HEAD_DIMS = (64, 128, 256)


def auto_prefill_name(base: str, config: AttentionConfig,
                      capability: tuple[int, int] | None = None) -> str:
    """What 'auto' prefills with: `base`, except that on Hopper (sm_90), where FlashInfer was the
    pick and the cache holds the activation dtype, FlashInfer's FA3 kernels prefill. On an H100
    (Qwen3-8B, bench.prefill) they took 8 x 8,192-token prompts from 69 % to 76 % of the bf16
    GEMM peak and one 32,768-token prompt from 59 % to 74 % (vLLM's FA3 in the same machine:
    78 %); offline throughput is unchanged (its prefill is a small share). An fp8 cache keeps
    FA2 ("flashinfer"): FA3 wants q in fp8 too. `capability` is for tests; by default the device's."""
    if base != "flashinfer" or config.device.type != "cuda":
        return base
    major, _ = capability or torch.cuda.get_device_capability(config.device)
    if (major != 9 or config.cache_dtype != config.dtype or config.dtype not in _FA3_DTYPES
            or config.head_dim not in _FA3_HEAD_DIMS):
        return base
    return "fa3"


def refusal(cls: type[AttentionBackend], layers: tuple[LayerAttention, ...]) -> str | None:
    """Why `cls` cannot serve a model whose layers are `layers` (the first reason), or None."""
    for i, spec in enumerate(layers or (PLAIN,)):
        why = cls.unsupported(spec)
        if why:
            return f"layer {i}: {why}"
    return None


# What "auto" falls back to, in order, when its pick has no kernel for a model's layers.
_AUTO_FALLBACKS = ("triton", "torch")


def _serving(name: str, auto: bool, layers: tuple[LayerAttention, ...],
             device: torch.device) -> str:
    """`name`, if its backend can serve `layers`; for an "auto" pick the first fallback that
    can; else BackendUnavailable naming the feature."""
    why = refusal(backend_class(name, device), layers)
    if why is None:
        return name
    if auto:
        for other in _AUTO_FALLBACKS:
            try:
                if refusal(backend_class(other, device), layers) is None:
                    return other
            except BackendUnavailable:
                continue
    raise BackendUnavailable(f"attention backend {name!r} cannot serve this model ({why}); "
                             "use --attention-backend auto or torch")


def choose_names(name: str, config: AttentionConfig, prefill: str | None = None,
                 decode: str | None = None) -> tuple[str, str]:
    """The concrete (prefill, decode) backend names for `name` and the overrides, each able to
    serve the model's layers (or BackendUnavailable)."""
    device = config.device
    base = resolve_name(name, device)
    if prefill:
        p_name = resolve_name(prefill, device)
    else:
        p_name = auto_prefill_name(base, config) if name == "auto" else base
    if decode:
        d_name = resolve_name(decode, device)
    elif name == "auto":
        d_name = auto_decode_name(base)
    else:
        d_name = base
    p_name = _serving(p_name, not prefill and name == "auto", config.layers, device)
    d_name = _serving(d_name, not decode and name == "auto", config.layers, device)
    return p_name, d_name


def create_backend(name: str, config: AttentionConfig, pool: KVPool,
                   prefill: str | None = None, decode: str | None = None) -> AttentionBackend:
    """`name` for every step, unless `prefill` or `decode` overrides one kind (hybrid)."""
    device = config.device
    p_name, d_name = choose_names(name, config, prefill, decode)
    p_cls, d_cls = backend_class(p_name, device), backend_class(d_name, device)
    p = p_cls(config, pool)
    if d_name == p_name:
        return p
    return HybridBackend(p, d_cls(config, pool))


def describe(backend: AttentionBackend) -> str:
    if isinstance(backend, HybridBackend):
        return f"{backend.prefill.name}+{backend.decode.name}"
    return backend.name


__all__ = [
    "AttentionBackend", "AttentionConfig", "BackendUnavailable", "ForwardBatch", "HybridBackend",
    "LayerAttention", "PLAIN", "BACKEND_NAMES", "auto_decode_name", "auto_prefill_name",
    "backend_class", "choose_names", "create_backend", "describe", "refusal", "resolve_name",
]
