"""Roofline estimate for a workload: the fewest bytes a step-by-step decode must move, over bandwidth.

Decode is memory-bound: every step reads all weights once (shared by the batch) and each running
request's KV cache. Prefill is compute-bound: ~2 FLOPs per parameter per prompt token.

The KV a decode token reads: full-attention layers read the whole context, sliding-window layers
(Gemma 3, gpt-oss, Mistral v0.1) at most their window; a layer's K/V per token is 2 x KV heads x
head_dim values, or for multi-head latent attention (DeepSeek) one latent of kv_lora_rank +
qk_rope_head_dim values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MXFP4_BYTES = 17 / 32  # bytes a weight of MXFP4: a 4-bit element, a byte of scale per 32


def prequantized_bytes(qc: dict) -> tuple[float, bool] | None:
    """(bytes a weight of the projections and experts, runs on fp8/int8 tensor cores) of a
    pre-quantized checkpoint's quantization_config; None for none (or MXFP4: experts only)."""
    method = qc.get("quant_method")
    if method == "fp8" or (method == "compressed-tensors"
                           and qc.get("format") in ("float-quantized", "int-quantized")):
        return 1.0, True  # block scales add 4 bytes a 128x128 block: ignored
    if method in ("awq", "gptq") or (method == "compressed-tensors"
                                     and qc.get("format") == "pack-quantized"):
        group = qc.get("group_size") or qc.get("q_group_size") or 128
        if method == "compressed-tensors":
            weights = next(iter(qc.get("config_groups", {}).values()), {}).get("weights", {})
            group = weights.get("group_size") or 128
        group = group if group > 0 else 4096  # per channel: one scale a column
        zeros = method == "awq" or not qc.get("sym", True)
        return 0.5 + (2 + (2 if zeros else 0)) / group, False  # scales (and zeros) per group
    return None


@dataclass
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int  # weights read per decode step of one request (active experts for MoE)
    active_params: int
    dtype_bytes: int = 2
    # MoE: a batch reads every expert some request routed to, not just k of them.
    num_experts: int = 0
    experts_per_tok: int = 0
    expert_bytes: int = 0  # one expert's weights, all layers (this rank's share)
    kv_dtype_bytes: int | None = None  # KV cache element size; None: dtype_bytes (fp8 cache: 1)
    # --quantization fp8: the share of active_params in fp8 projections and experts, which
    # prefill runs at twice the bf16 rate (weight_bytes already counts them at one byte each)
    fp8_param_share: float = 0.0
    window_layers: int = 0  # layers with a sliding window, which read at most `window` tokens
    window: int = 0
    latent_dim: int = 0  # MLA: values cached a token and layer (kv_lora_rank + rope dims)

    def step_weight_bytes(self, batch: int) -> float:
        """Weights one decode step of `batch` requests reads. MoE: the expected number of
        distinct experts hit when each request picks k of E uniformly, E(1 - (1 - k/E)^B);
        at batch 256 with k=8 of 128 that is all of them."""
        if not self.num_experts or batch <= 1:
            return self.weight_bytes
        e, k = self.num_experts, self.experts_per_tok
        touched = e * (1 - (1 - k / e) ** batch)
        return self.weight_bytes + (touched - k) * self.expert_bytes

    @property
    def kv_layer_bytes(self) -> int:
        """K/V bytes one token holds in one layer."""
        kv = self.kv_dtype_bytes or self.dtype_bytes
        if self.latent_dim:
            return self.latent_dim * kv
        return 2 * self.num_kv_heads * self.head_dim * kv

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V bytes of one token over every layer (windowed layers included)."""
        return self.num_layers * self.kv_layer_bytes

    def kv_read_bytes(self, context: int) -> int:
        """K/V bytes a decode token over `context` cached tokens reads."""
        full = self.num_layers - self.window_layers
        seen = full * context + self.window_layers * min(context, self.window or context)
        return seen * self.kv_layer_bytes

    @classmethod
    def from_config(cls, path: str | Path, dtype_bytes: int = 2, tp_size: int = 1,
                    kv_dtype_bytes: int | None = None, fp8_weights: bool = False) -> ModelShape:
        """fp8_weights: the projections and MoE experts are one byte a weight (--quantization
        fp8), and their prefill FLOPs run at twice the bf16 rate (fp8 x fp8 tensor cores);
        embeddings, the LM head and the router stay in dtype_bytes."""
        cfg = json.loads((Path(path) / "config.json").read_text())
        cfg = cfg.get("text_config") or cfg  # Gemma 3 multimodal checkpoints: the text model
        # gpt-oss's MXFP4 checkpoints: experts in FP4 with an e8m0 scale a 32 (4.25 bits)
        qc = cfg.get("quantization_config") or {}
        mxfp4 = qc.get("quant_method") == "mxfp4"
        # other pre-quantized checkpoints: projections and experts at their format's bytes
        pre = prequantized_bytes(qc)
        q_bytes = pre[0] if pre else 1.0 if fp8_weights else float(dtype_bytes)
        fp8_weights = fp8_weights or pre is not None
        fast_mma = pre[1] if pre else fp8_weights
        h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
        heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads",
                                                                cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or h // heads
        vocab = cfg["vocab_size"]
        latent = 0
        if cfg.get("kv_lora_rank"):  # multi-head latent attention
            rope, nope, v = (cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"],
                             cfg["v_head_dim"])
            q_rank = cfg.get("q_lora_rank")
            q = h * q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
            latent = cfg["kv_lora_rank"] + rope
            attn = q + h * latent + cfg["kv_lora_rank"] * heads * (nope + v) + heads * v * h
            kv_heads, head_dim = 1, latent
        else:
            attn = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h
        moe: dict[str, int] = {}
        num_experts = (cfg.get("num_experts") or cfg.get("num_local_experts")
                       or cfg.get("n_routed_experts") or 0)
        dense_mlp = 3 * h * cfg.get("intermediate_size", 0)
        experts_active = 0  # params of the k experts one token is routed to, one layer
        if num_experts:  # MoE: only routed experts' weights are read per token
            k = cfg.get("num_experts_per_tok") or cfg["experts_per_token"]
            inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
            shared = 3 * h * inter * (cfg.get("n_shared_experts") or 0)
            dense = cfg.get("first_k_dense_replace", 0)  # DeepSeek: dense MLPs first
            mlp_active = 3 * h * inter * k + h * num_experts + shared
            expert_elem_bytes = MXFP4_BYTES if mxfp4 else q_bytes
            moe = dict(num_experts=num_experts, experts_per_tok=k,
                       expert_bytes=int((layers - dense) * 3 * h * inter * expert_elem_bytes)
                       // tp_size)
            experts_active = 3 * h * inter * k
            mlp_total = (layers - dense) * mlp_active + dense * dense_mlp
            fp8_mlp_total = (layers - dense) * (experts_active + shared) + dense * dense_mlp
        else:
            mlp_total = fp8_mlp_total = layers * dense_mlp
        embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
        active = layers * attn + mlp_total + embed
        fp8 = layers * attn + fp8_mlp_total if fp8_weights else 0  # the router stays
        weight_bytes = int((active - fp8) * dtype_bytes + fp8 * q_bytes)
        if mxfp4 and num_experts:  # the routed experts at 4.25 bits a weight, the rest bf16
            packed = (layers - dense) * experts_active
            weight_bytes = int((active - packed) * dtype_bytes + packed * MXFP4_BYTES)
        window, window_layers = _windows(cfg, layers)
        return cls(num_layers=layers, num_kv_heads=max(1, kv_heads // tp_size) if not latent
                   else 1, head_dim=head_dim, weight_bytes=weight_bytes // tp_size,
                   active_params=active // tp_size, dtype_bytes=dtype_bytes,
                   kv_dtype_bytes=kv_dtype_bytes,
                   fp8_param_share=fp8 / active if fast_mma else 0.0,
                   window_layers=window_layers, window=window, latent_dim=latent, **moe)


def _windows(cfg: dict, layers: int) -> tuple[int, int]:
    """(window, how many layers have it) from `layer_types`, Gemma's `sliding_window_pattern`
    (every pattern-th layer global), or a `sliding_window` on every layer."""
    window = cfg.get("sliding_window") or 0
    if not window or cfg.get("use_sliding_window") is False:
        return 0, 0
    types = cfg.get("layer_types")
    if types:
        return window, sum(1 for t in types if t == "sliding_attention")
    pattern = cfg.get("sliding_window_pattern")
    if pattern:
        return window, layers - layers // pattern
    return window, layers


def roofline_seconds(shape: ModelShape, prompt_lens: list[int], output_lens: list[int],
                     hbm_bytes_per_s: float, flops_per_s: float) -> dict[str, float]:
    """All requests start together (batch = everything that fits); one decode step per token."""
    kv_bytes = 0
    for p, o in zip(prompt_lens, output_lens, strict=True):
        # decode token i (1..o-1) reads p + i cached tokens; the first token comes from prefill
        if shape.window_layers:
            kv_bytes += sum(shape.kv_read_bytes(p + i) for i in range(1, o))
        else:
            kv_bytes += shape.kv_bytes_per_token * sum(p + i for i in range(1, o))
    steps = max(output_lens)
    # Step i decodes every request with more than i outputs to make.
    weight_bytes = sum(shape.step_weight_bytes(sum(1 for o in output_lens if o > i))
                       for i in range(steps))
    # fp8 projections run at twice the bf16 rate: count their FLOPs at half weight
    prefill_flops = 2 * shape.active_params * sum(prompt_lens) * (1 - shape.fp8_param_share / 2)
    parts = {
        "kv_s": kv_bytes / hbm_bytes_per_s,
        "weights_s": weight_bytes / hbm_bytes_per_s,
        "prefill_s": prefill_flops / flops_per_s,
    }
    parts["total_s"] = sum(parts.values())
    return parts


def measure_hbm_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (CUDA only)."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    times.sort()
    return 2 * n / times[len(times) // 2]
