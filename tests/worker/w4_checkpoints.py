"""Tiny 4-bit checkpoints in the publishers' on-disk layouts, written from an unquantized
safetensors checkpoint, and the dequantized weights they stand for (the reference HF
transformers computes with). Written independently of the engine (nibble by nibble loops here,
none of its unpack/repack code), after AutoAWQ's WQLinear_GEMM, AutoGPTQ / GPTQModel's packer and
compressed-tensors' pack_to_int32:

  awq        qweight int32 [K, N/8] nibble i of column c = output 8c + [0,2,4,6,1,3,5,7][i];
             qzeros [K/G, N/8] likewise; scales fp16 [K/G, N]; W = (q - z) * s
  gptq       v1, asymmetric: qweight [K/8, N] nibble j of row r = input 8r + j; qzeros
             [K/G, N/8] nibble j of column c = output 8c + j holding z - 1; g_idx = k // G
  gptq_act   v1, symmetric (stored zeros 7), desc_act: g_idx a permutation's groups (q|k|v and
             gate|up share theirs), qweight rows still in input order
  gptq_v2    gptq_v2, asymmetric: zeros stored as they are
  ct_sym     pack-quantized, symmetric group: weight_packed [N, K/8] (signed q + 8, nibble j of
             column c = input 8c + j), weight_scale bf16 [N, K/G], weight_shape
  ct_asym    as ct_sym with weight_zero_point int32 [N/8, K/G] (signed z + 8, packed along N)
  ct_channel symmetric, strategy channel: weight_scale [N, 1]
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("awq", "gptq", "gptq_act", "gptq_v2", "ct_sym", "ct_asym", "ct_channel")
PROJ = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(?:experts\.(\d+)\.)?(\w+)_proj\.weight$")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# the input a projection reads: its packed parts share act-order g_idx
INPUT_OF = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up",
            "down": "down"}


def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit words -> the same bits as int32."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_awq(v: torch.Tensor) -> torch.Tensor:
    """[R, C] nibbles -> int32 [R, C/8], AWQ's interleaved column order."""
    out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for c in range(v.shape[1] // 8):
        for i in range(8):
            out[:, c] |= v[:, 8 * c + AWQ_ORDER[i]].long() << (4 * i)
    return _int32(out)


def pack_cols(v: torch.Tensor) -> torch.Tensor:
    """[R, C] nibbles -> int32 [R, C/8], entry 8c + j at bits 4j of column c."""
    out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for c in range(v.shape[1] // 8):
        for j in range(8):
            out[:, c] |= v[:, 8 * c + j].long() << (4 * j)
    return _int32(out)


def pack_rows(v: torch.Tensor) -> torch.Tensor:
    """[R, C] nibbles -> int32 [R/8, C], entry 8r + j at bits 4j of row r."""
    return pack_cols(v.t().contiguous()).t().contiguous()


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool, scale_dtype: torch.dtype,
              zmin: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] fp32, g_idx [K] -> (q [N, K] in 0..15, scales [N, groups] (scale_dtype),
    zeros [N, groups] in zmin..15, dequantized [N, K] fp32), one group at a time."""
    n, k = w.shape
    q = torch.zeros(n, k, dtype=torch.int64)
    s_all = torch.zeros(n, groups, dtype=scale_dtype)
    z_all = torch.zeros(n, groups, dtype=torch.int64)
    deq = torch.zeros(n, k)
    for g in range(groups):
        cols = torch.nonzero(g_idx == g).flatten()
        wg = w[:, cols]
        if sym:
            s = (wg.abs().amax(1) / 7.0).clamp_min(1e-6).to(scale_dtype).float()
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = wg.amin(1).clamp(max=0.0), wg.amax(1).clamp(min=0.0)
            s = ((hi - lo) / 15.0).clamp_min(1e-6).to(scale_dtype).float()
            z = torch.round(-lo / s).long().clamp(zmin, 15)
        qg = torch.round(wg / s[:, None] + z[:, None]).long().clamp(0, 15)
        q[:, cols] = qg
        deq[:, cols] = (qg - z[:, None]).float() * s[:, None]
        s_all[:, g], z_all[:, g] = s.to(scale_dtype), z
    return q, s_all, z_all, deq


def _g_idx(k: int, group: int, perm: torch.Tensor | None) -> torch.Tensor:
    g = torch.arange(k) // group
    if perm is None:
        return g
    out = torch.empty(k, dtype=torch.int64)
    out[perm] = g  # the i-th feature quantized (perm[i]) is in group i // G
    return out


def quantize_module(fmt: str, w: torch.Tensor, group: int,
                    perm: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection's checkpoint tensors (suffix -> tensor) and its dequantized weight."""
    n, k = w.shape
    g = k if fmt == "ct_channel" else group
    g_idx = _g_idx(k, g, perm if fmt == "gptq_act" else None)
    sym = fmt in ("gptq_act", "ct_sym", "ct_channel")
    scale_dtype = torch.bfloat16 if fmt.startswith("ct") else torch.float16
    v1 = fmt in ("gptq", "gptq_act")
    q, s, z, deq = _quantize(w, g_idx, k // g, sym, scale_dtype, zmin=1 if v1 else 0)
    if fmt == "awq":
        return {"qweight": pack_awq(q.t()), "qzeros": pack_awq(z.t()),
                "scales": s.t().contiguous()}, deq
    if fmt.startswith("gptq"):
        stored = (z - 1) if v1 else z
        return {"qweight": pack_rows(q.t()), "qzeros": pack_cols(stored.t()),
                "scales": s.t().contiguous(), "g_idx": g_idx.to(torch.int32)}, deq
    out = {"weight_packed": pack_cols(q), "weight_scale": s,
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if fmt == "ct_asym":
        out["weight_zero_point"] = pack_rows(z)
    return out, deq


def quantization_config(fmt: str, group: int, ignore: list[str]) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": ignore or None}
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group,
                "desc_act": fmt == "gptq_act", "sym": fmt == "gptq_act",
                "checkpoint_format": "gptq_v2" if fmt == "gptq_v2" else "gptq",
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
                "pack_dtype": "int32", "lm_head": False, "meta": {"quantizer": ["test"]}}
    channel = fmt == "ct_channel"
    weights = {"num_bits": 4, "type": "int", "symmetric": fmt != "ct_asym",
               "strategy": "channel" if channel else "group",
               "group_size": None if channel else group, "dynamic": False, "actorder": None,
               "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None,
                                          "format": "pack-quantized"}},
            "ignore": ["lm_head", *ignore], "quantization_status": "compressed",
            "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None,
            "version": "0.10.2"}


def write_w4_checkpoint(src: Path, dst: Path, fmt: str, group: int,
                        ignore: list[str] = (), seed: int = 0) -> dict[str, torch.Tensor]:  # type: ignore[assignment]
    """dst: src's files with every layer projection (experts too; but `ignore`, module names)
    in format `fmt`; returns the dequantized state dict (all tensors, fp32)."""
    assert fmt in FORMATS, fmt
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        m = PROJ.match(name)
        module = name[: -len(".weight")]
        if m is None or module in ignore:
            out[name], ref[name] = w, w.float()
            continue
        key = (f"{m.group(1)}.{m.group(3)}", INPUT_OF[m.group(4)])
        if key not in perms:
            perms[key] = torch.randperm(w.shape[1], generator=gen)
        tensors, deq = quantize_module(fmt, w.float(), group, perms[key])
        for suffix, t in tensors.items():
            out[f"{module}.{suffix}"] = t
        ref[name] = deq
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(fmt, group, list(ignore))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return ref
