"""A rank's start-up, one step a function, in the order `ModelRunner.__init__` calls them:

    prepare_rank              switches, page size, device, quantization (before any spawning)
    check_backend_names       a bad attention backend name fails before any loading
    load_model_config         the HF config (EOS ids outside the vocabulary dropped)
    check_backend_features    the backends have kernels for the model's layers (windows, ...)
    context_length            the longest sequence served
    shard_heads               this rank's attention and KV heads
    load_weights              the model on the device
    init_fast_all_reduce      TP on CUDA: the one-/two-shot all-reduce kernels and their buffers
    size_kv_cache             pages of the KV cache (an explicit count, a token count on CPU, or
                              what fits in the memory budget, the same on every rank);
                              size_kv_pools: the same split between the main pool and the
                              sliding-window layers' pool (window_layout)
    make_kv_pool              the KV cache and the page table
    choose_backend            the attention backend(s) for prefill and decode steps
    make_sampler              the sampler (the same seed on every rank)
    choose_vocab_shard        TP: draw from this rank's vocabulary shard when a batch allows
    capture_decode_graphs     CUDA: one graph per decode batch size
    (ModelRunner.warm_up_prefill: throwaway prefills compile the kernels)
    capture_piecewise_graphs  CUDA: prefill and mixed steps in pieces (after the warm-up)

Each takes what it needs as arguments, so a test can run one alone.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from minisgl_core.config import DEFAULT_MAX_PREFILL_TOKENS

from .. import distributed as dist
from .. import env
from ..attention import (
    AttentionBackend,
    AttentionConfig,
    backend_class,
    choose_names,
    create_backend,
    resolve_name,
)
from ..attention.kv_pool import KVPool
from ..config import EngineConfig
from ..fp8 import check_supported as check_quantization
from ..loader import load_model
from ..model_config import ModelConfig
from ..models import CausalLM, model_class
from ..sampling import Sampler
from ..sampling.grammar import find_tokenizer
from ..sampling.sharded import FLOAT32_EXACT_IDS, VocabShard
from .piecewise_graph import PiecewiseGraphs

if TYPE_CHECKING:
    from .cuda_graph import CudaGraphRunner

log = logging.getLogger(__name__)


def prepare_rank(config: EngineConfig) -> tuple[EngineConfig, torch.device]:
    """A rank's start-up before anything is spawned or joined: the switches read, the config
    with its page size resolved, this rank's device (made current), the quantization checked."""
    env.reload()
    device = config.torch_device()
    config = replace(config, page_size=config.resolved_page_size(device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    check_quantization(config.quantization, device, config.torch_dtype(device))
    return config, device


def check_backend_names(config: EngineConfig, device: torch.device) -> None:
    """Raises on an unknown attention backend name, or one this device cannot run: before the
    weights load, which is slow for a large model."""
    for name in (config.attention_backend, config.prefill_attention_backend,
                 config.decode_attention_backend):
        if name:
            backend_class(resolve_name(name, device), device)


def load_model_config(config: EngineConfig) -> ModelConfig:
    """The model's HF config with the overrides; EOS ids outside the vocabulary (e.g. under a
    vocab_size override for a small dummy model) are dropped, since the sampler would refuse
    them."""
    mc = ModelConfig.load(config.model_path, config.hf_overrides)
    outside = [t for t in mc.eos_token_ids if not 0 <= t < mc.vocab_size]
    if outside:
        log.warning("eos token ids %s lie outside the vocabulary; ignored", outside)
        mc.eos_token_ids = [t for t in mc.eos_token_ids if 0 <= t < mc.vocab_size]
    return mc


def context_length(config: EngineConfig, mc: ModelConfig) -> int:
    """--max-model-len, else the model's."""
    return config.max_model_len or mc.max_position_embeddings


def attention_config(config: EngineConfig, mc: ModelConfig, heads: int, kv_heads: int,
                     page_size: int, max_pages_per_seq: int, max_model_len: int,
                     dtype: torch.dtype, kv_dtype: torch.dtype,
                     device: torch.device) -> AttentionConfig:
    """What the attention backends compute for this model on this rank."""
    cls = model_class(mc.architecture)
    return AttentionConfig(heads, kv_heads, cls.kv_layout(mc).head_dim, cls.attention_scale(mc),
                           page_size,
                           config.max_slots, max_pages_per_seq, max_model_len, dtype, device,
                           kv_dtype=kv_dtype, layers=cls.attention_layers(mc))


def check_backend_features(config: EngineConfig, mc: ModelConfig, device: torch.device) -> None:
    """Raises when the chosen attention backend has no kernel for a feature the model's layers
    need (a sliding window, a soft-cap, sinks): before the weights load. "auto" always finds
    one (attention.choose_names)."""
    heads, kv_heads = shard_heads(mc)
    attn_cfg = attention_config(config, mc, heads, kv_heads, 1, 1, 1, config.torch_dtype(device),
                                config.torch_kv_dtype(device), device)
    choose_names(config.attention_backend, attn_cfg, config.prefill_attention_backend,
                 config.decode_attention_backend)


def shard_heads(mc: ModelConfig) -> tuple[int, int]:
    """This rank's (attention heads, KV heads); raises when TP does not split them evenly.
    MLA's one latent KV head is on every rank."""
    layout = model_class(mc.architecture).kv_layout(mc)
    kv_heads = (layout.num_kv_heads if layout.v_dim is not None
                else dist.shard(layout.num_kv_heads, "kv heads"))
    return dist.shard(mc.num_heads, "heads"), kv_heads


def load_weights(config: EngineConfig, mc: ModelConfig, max_model_len: int,
                 device: torch.device, dtype: torch.dtype) -> CausalLM:
    load_format = "safetensors" if config.load_format == "auto" else config.load_format
    t0 = time.perf_counter()
    model = load_model(config.model_path, mc, load_format, max_model_len, device, dtype,
                       config.dummy_seed, config.quantization)
    log.info("model %s loaded (%s, %s, quantization %s) in %.1fs", mc.architecture, dtype,
             load_format, config.quantization, time.perf_counter() - t0)
    return model


def init_fast_all_reduce(config: EngineConfig, mc: ModelConfig, device: torch.device,
                         dtype: torch.dtype) -> int:
    """At TP > 1 on CUDA (unless disabled), installs the one-shot all-reduce (and the two-shot
    one for longer steps) into the TP group. Returns the longest step whose all-reduces avoid
    NCCL (0: none). Runs before the KV cache is sized: its buffers come out of the budget."""
    tp = config.tp_size
    if tp == 1 or device.type != "cuda" or config.disable_custom_all_reduce:
        return 0
    from ..kernels.all_reduce import OneShotAllReduce  # Triton: CUDA builds only

    fast = OneShotAllReduce.create(
        config.tp_rank, tp, dist.tp().cpu_group, device,
        max_bytes=config.custom_all_reduce_max_mb << 20,
        large_bytes=config.two_shot_step_tokens() * mc.hidden_size * dtype.itemsize)
    dist.use_fast_all_reduce(fast)
    if fast is not None and fast.large is not None:
        return config.two_shot_step_tokens()
    return 0


def kv_budget_bytes(free: int, total: int, mem_fraction: float) -> float:
    """What the KV cache may take: `mem_fraction` of the device's memory, less what is in use
    already (weights, workspaces, all-reduce buffers)."""
    return total * mem_fraction - (total - free)


def size_kv_cache(config: EngineConfig, mc: ModelConfig, kv_heads: int, page_size: int,
                  kv_dtype: torch.dtype, device: torch.device,
                  memory: tuple[int, int] | None = None) -> int:
    """Pages of the KV cache: --num-pages if given; on a CPU (no `memory` given) enough for
    --kv-cache-tokens; else as many as fit in `kv_budget_bytes` of the device's (free, total)
    memory (`memory`, default: asked of CUDA), the fewest over the TP ranks, since every rank
    must hold the same pages. Raises when not one page fits."""
    if config.num_pages is not None:
        return config.num_pages
    if memory is None and device.type != "cuda":
        return max(1, -(-config.kv_cache_tokens // page_size))
    layout = model_class(mc.architecture).kv_layout(mc)
    per_page = KVPool.bytes_per_page(mc.num_layers, page_size, kv_heads, layout.head_dim,
                                     kv_dtype, layout.v_dim)
    free, total = memory if memory is not None else torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(free, total, config.mem_fraction)
    pages = torch.tensor([int(budget // per_page)], device=device)
    if config.tp_size > 1:
        torch.distributed.all_reduce(pages, op=torch.distributed.ReduceOp.MIN)
    n = int(pages.item())
    if n < 1:
        raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} "
                           f"GiB); raise --mem-fraction or use more GPUs (TP)")
    return n


@dataclass(frozen=True)
class WindowLayout:
    """Which layers keep their KV in the window pool, and the largest of their windows."""

    layers: frozenset[int] = frozenset()
    window: int = 0


def window_layout(mc: ModelConfig, max_model_len: int) -> WindowLayout:
    """The sliding-window layers whose window is shorter than the longest sequence served: only
    those gain from a pool that drops KV outside the window (none: no window pool at all)."""
    specs = model_class(mc.architecture).attention_layers(mc)
    layers = frozenset(i for i, s in enumerate(specs)
                       if s.window is not None and s.window < max_model_len)
    return WindowLayout(layers, max((specs[i].window or 0) for i in layers) if layers else 0)


def window_pages_wanted(config: EngineConfig, layout: WindowLayout, page_size: int) -> int:
    """--window-pages when given; else window pages for every slot at once: each running
    request holds its window plus the page boundary kept for prefix reuse and the page it
    writes (ceil(window / ps) + 2); one
    step's prefill chunk adds its pages twice over (the chunk's own, and the ones the previous,
    still running step may read after the scheduler dropped them) plus a straddled page per
    slot. Doubled: the other half keeps dropped requests' last windows cached, so shared
    prefixes and the next turn of a conversation keep hitting."""
    if config.window_pages is not None:
        return config.window_pages
    chunk = config.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS
    per_slot = -(-layout.window // page_size) + 3
    return 2 * (config.max_slots * per_slot + 2 * -(-chunk // page_size))


def size_kv_pools(config: EngineConfig, mc: ModelConfig, kv_heads: int, page_size: int,
                  kv_dtype: torch.dtype, device: torch.device, layout: WindowLayout,
                  max_model_len: int, memory: tuple[int, int] | None = None) -> tuple[int, int]:
    """(main pool pages, window pool pages). Without windowed layers: size_kv_cache and 0.
    Else the window pool gets `window_pages_wanted` (never more pages than the main pool: a
    window page always sits next to a main one) and the main pool, which then holds only the
    full-attention layers, the rest of the budget; a budget too small for both splits evenly
    (as many window as main pages). A model of windowed layers only has no main-pool memory:
    the budget is all window pool and the main pool is bookkeeping, a row per slot."""
    if not layout.layers:
        return size_kv_cache(config, mc, kv_heads, page_size, kv_dtype, device, memory), 0
    full_layers = mc.num_layers - len(layout.layers)
    want = window_pages_wanted(config, layout, page_size)
    if config.num_pages is not None or (memory is None and device.type != "cuda"):
        pages = size_kv_cache(config, mc, kv_heads, page_size, kv_dtype, device, memory)
        return pages, min(pages, want)
    full_b = KVPool.bytes_per_page(full_layers, page_size, kv_heads, mc.head_dim, kv_dtype)
    win_b = KVPool.bytes_per_page(len(layout.layers), page_size, kv_heads, mc.head_dim, kv_dtype)
    free, total = memory if memory is not None else torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(free, total, config.mem_fraction)
    if full_b == 0:
        win = int(budget // win_b)
        pages = max(win, config.max_slots * -(-max_model_len // page_size))
    else:
        win = want
        pages = int((budget - win * win_b) // full_b)
        if pages < win:
            pages = win = int(budget // (full_b + win_b))
    both = torch.tensor([pages, win], device=device)
    if config.tp_size > 1:
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN)
    pages, win = (int(x) for x in both.tolist())
    if win < 1:
        raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} "
                           f"GiB); raise --mem-fraction or use more GPUs (TP)")
    if win < want:
        log.warning("the sliding-window KV pool has %d pages, fewer than the %d that let all "
                    "%d slots run at once: requests will wait or be preempted", win, want // 2,
                    config.max_slots)
    return pages, win


def make_kv_pool(config: EngineConfig, mc: ModelConfig, kv_heads: int, num_pages: int,
                 page_size: int, max_model_len: int, kv_dtype: torch.dtype,
                 device: torch.device, layout: WindowLayout | None = None,
                 window_pages: int = 0) -> KVPool:
    """The KV cache, with a page-table row of ceil(max_model_len / page_size) for every slot;
    with `window_pages`, the layers of `layout` in a window pool of that many pages."""
    max_pages_per_seq = -(-max_model_len // page_size)
    kv = model_class(mc.architecture).kv_layout(mc)
    layers = layout.layers if layout is not None and window_pages else frozenset()
    return KVPool(mc.num_layers, num_pages, page_size, kv_heads, kv.head_dim, kv_dtype, device,
                  config.max_slots, max_pages_per_seq, v_dim=kv.v_dim, window_layers=layers,
                  window_pages=window_pages if layers else 0)


def choose_backend(config: EngineConfig, mc: ModelConfig, heads: int, pool: KVPool,
                   max_model_len: int, dtype: torch.dtype) -> AttentionBackend:
    """--attention-backend (with the prefill / decode overrides: a hybrid) over `pool`; "auto"
    picks for the device (attention/__init__.py)."""
    attn_cfg = attention_config(config, mc, heads, pool.num_kv_heads, pool.page_size,
                                pool.max_pages_per_seq, max_model_len, dtype, pool.dtype,
                                pool.device)
    return create_backend(config.attention_backend, attn_cfg, pool,
                          config.prefill_attention_backend, config.decode_attention_backend)


def make_sampler(config: EngineConfig, mc: ModelConfig, device: torch.device) -> Sampler:
    """The sampler, its grammar tokenizer built in the background. At TP > 1 rank 0's seed goes
    to every rank (a collective): ranks must draw alike, from the same logits and seeds."""
    seed = config.sampler_seed
    if config.tp_size > 1:
        seed = dist.broadcast_object(seed if seed is not None else
                                     int(torch.randint(0, 2**62, (1,))))
    sampler = Sampler(config.max_slots, mc.vocab_size, device, eos_token_ids=mc.eos_token_ids,
                      seed=seed, tokenizer_path=find_tokenizer(config.model_path),
                      grammar_cache_bytes=config.grammar_cache_mib << 20,
                      # Ranks must mask alike: a deadline met on one rank and missed on
                      # another would split their draws, so at TP > 1 only the compile's
                      # bounds (identical on every rank) end a request.
                      grammar_compile_timeout=(config.grammar_compile_timeout
                                               if config.tp_size == 1 else math.inf))
    sampler.grammars.compiler.warm()
    return sampler


def choose_vocab_shard(config: EngineConfig, mc: ModelConfig) -> VocabShard | None:
    """At TP > 1 the LM head hands out this rank's shard; greedy and temperature-only batches
    draw from it without gathering the logits (sampling/sharded.py). None: always gather (TP 1,
    disabled, or a vocabulary past 2**24, whose ids would not cross the ranks exactly as
    float32)."""
    tp = config.tp_size
    if tp > 1 and not config.disable_sharded_sampling and mc.vocab_size < FLOAT32_EXACT_IDS:
        return VocabShard.of_rank(mc.vocab_size, config.tp_rank, tp)
    return None


def capture_decode_graphs(config: EngineConfig, model: CausalLM, backend: AttentionBackend,
                          pool: KVPool, vocab_shard: VocabShard | None,
                          ) -> CudaGraphRunner | None:
    """On CUDA with a backend that supports it, the decode graphs (cuda_graph.py); else None:
    decode steps run eagerly."""
    if (pool.device.type != "cuda" or config.disable_cuda_graph
            or not getattr(backend, "supports_cuda_graph", False)):
        return None
    try:
        from .cuda_graph import CudaGraphRunner
    except ImportError:
        log.info("CUDA graphs: no runner in this build; running eagerly")
        return None
    # The LM head runs inside the graph: launches spared per step, and fixed GEMM shapes.
    # With TP its all-gather too, unless the draw may be sharded: then the graph ends at this
    # rank's shard and the runner gathers after the replay only for batches that need it.
    logits: Callable[[torch.Tensor], torch.Tensor] = (
        model.compute_local_logits if vocab_shard is not None
        else lambda hidden: model.compute_logits(hidden, fp32=False))
    return CudaGraphRunner(model, backend, pool, config.cuda_graph_max_bs, logits=logits)


def capture_piecewise_graphs(config: EngineConfig, model: CausalLM, backend: AttentionBackend,
                             pool: KVPool) -> PiecewiseGraphs | None:
    """On CUDA (unless disabled) the graphs of prefill and mixed steps up to
    --piecewise-max-tokens (piecewise_graph.py); else None. After the warm-up: the kernels they
    capture are compiled by then."""
    if (pool.device.type != "cuda" or config.disable_cuda_graph
            or config.piecewise_max_tokens < 1):
        return None
    longest = (config.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS) + config.max_slots
    return PiecewiseGraphs(model, backend, pool, min(config.piecewise_max_tokens, longest))
