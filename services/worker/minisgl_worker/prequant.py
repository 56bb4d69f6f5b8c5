"""Pre-quantized checkpoints: which `quantization_config` formats load, read from config.json.

Three FP8 (e4m3) layouts load (docs/operations.md, "Pre-quantized checkpoints"):

  block    quant_method "fp8" with weight_block_size [128, 128] (Qwen3-*-FP8, DeepSeek-V3):
           `weight` fp8 [N, K], `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)], one scale a
           128x128 block; activations quantized per token and 128-wide group at run time.
  tensor   quant_method "fp8" without a block size: a scalar scale per linear (`weight_scale`,
           or transformers' `weight_scale_inv`); activations dynamic (per token here) or static
           (`input_scale`, a scalar).
  channel  compressed-tensors "float-quantized" W8A8: `weight_scale` [N, 1] (strategy channel)
           or [1] (strategy tensor), activations dynamic per token or static per tensor.

Everything else in a quantization_config stops start-up with one line naming the field and its
value (never serve wrong): the config is parsed here, whole, before any weight is read. Which
layers are fp8 is decided by the checkpoint itself (prequant_load.py: a projection with scale
tensors), so `modules_to_not_convert` / `ignored_layers` / `ignore` need no name matching: the
layers they list are stored unquantized and load as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .quant.config_checks import UNSET, check_args, compressed_group, names, refuse
from .quant.int8 import compressed_int8
from .quant.mxfp4 import parse_config as _mxfp4_config
from .quant.w4_config import w4_format

BLOCK = 128  # the only block size (and activation group) implemented


@dataclass(frozen=True)
class CheckpointQuant:
    """A pre-quantized checkpoint's format, as the loader and the layers need it."""

    method: str  # "fp8" | "compressed-tensors" | ...: what config.json says
    # "block" | "tensor" | "channel": fp8 weight scales (module doc); other formats name
    # themselves ("w4", "int8", "mxfp4") and keep their settings in `details`
    scheme: str
    static_activations: bool  # activations use the checkpoint's `input_scale` (per tensor)
    ignored: tuple[str, ...] = ()  # modules the config says stay unquantized (for the log)
    details: object = None  # a format's own settings (a dataclass of its quant/ module)

    @property
    def block(self) -> int | None:
        return BLOCK if self.scheme == "block" else None

    def describe(self) -> str:
        describe = getattr(self.details, "describe", None)  # the formats of quant/
        if describe is not None:
            return f"quant_method {self.method}: {describe()}"
        acts = "static per-tensor" if self.static_activations else (
            f"dynamic per-token-group({BLOCK})" if self.block else "dynamic per-token")
        return f"quant_method {self.method}: e4m3 weights, {self.scheme} scales, {acts} activations"


# quantization_config keys of quant_method "fp8" (transformers' FineGrainedFP8Config, vLLM's
# Fp8Config) and the values that are implemented; None: any value (validated below).
_FP8_KEYS: dict[str, tuple[object, ...] | None] = {
    "quant_method": None, "activation_scheme": ("dynamic", "static"),
    "weight_block_size": None, "modules_to_not_convert": None, "ignored_layers": None,
    "fmt": ("e4m3", "float8_e4m3fn"), "scale_fmt": ("float", None), "dequantize": (False,),
}


def _fp8(qc: dict[str, Any]) -> CheckpointQuant:
    for key, value in qc.items():
        if key not in _FP8_KEYS:
            raise refuse(key, value, "an fp8 setting this engine does not implement")
        allowed = _FP8_KEYS[key]
        if allowed is not None and value not in allowed:
            raise refuse(key, value, f"supported: {', '.join(map(repr, allowed))}")
    block = qc.get("weight_block_size")
    static = qc.get("activation_scheme", "dynamic") == "static"
    if block is not None and list(block) != [BLOCK, BLOCK]:
        raise refuse("weight_block_size", block, f"only [{BLOCK}, {BLOCK}] blocks load")
    if block is not None and static:
        raise refuse("activation_scheme", "static",
                      "block-quantized weights with static activation scales")
    ignored = names(qc.get("modules_to_not_convert"), "modules_to_not_convert") + names(
        qc.get("ignored_layers"), "ignored_layers")
    return CheckpointQuant("fp8", "block" if block is not None else "tensor", static, ignored)


# QuantizationArgs keys without effect on a stored fp8 tensor's meaning (calibration details)
_ARGS_INERT = ("observer", "observer_kwargs")


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    fmt = qc.get("format")
    if fmt == "int-quantized":  # INT8 W8A8: quant/int8.py
        int8 = compressed_int8(qc)
        return CheckpointQuant(qc["quant_method"], "int8", int8.static,
                               names(qc.get("ignore"), "ignore"), int8)
    if fmt != "float-quantized":
        raise refuse("format", fmt, "of compressed-tensors only float-quantized (FP8) loads")
    field, group = compressed_group(qc, "not implemented (only weights and activations)")
    statics: list[bool] = []
    for key, value in group.items():
        if key == "targets":
            if value != ["Linear"]:
                raise refuse(f"{field}.targets", value, "only ['Linear'] loads")
        elif key == "format":
            if value not in (None, "float-quantized"):
                raise refuse(f"{field}.format", value, "only float-quantized loads")
        elif key == "output_activations":
            if value is not None:
                raise refuse(f"{field}.output_activations", value, "not implemented")
        elif key == "weights":
            check_args(value or {}, f"{field}.weights", {
                "num_bits": (8,), "type": ("float",), "symmetric": (True,),
                "strategy": ("channel", "tensor"), "dynamic": (False,), "group_size": UNSET,
                "block_structure": UNSET, "actorder": UNSET}, _ARGS_INERT)
        elif key == "input_activations":
            if value is None:
                raise refuse(f"{field}.input_activations", None,
                              "weight-only fp8 (W8A16) is not implemented")
            dynamic = value.get("dynamic")
            check_args(value, f"{field}.input_activations", {
                "num_bits": (8,), "type": ("float",), "symmetric": (True,),
                "strategy": ("token",) if dynamic else ("tensor",), "dynamic": (True, False),
                "group_size": UNSET, "block_structure": UNSET, "actorder": UNSET}, _ARGS_INERT)
            statics.append(not dynamic)
        else:
            raise refuse(f"{field}.{key}", value, "a quantization group setting not implemented")
    if "weights" not in group:
        raise refuse(f"{field}.weights", None, "a group without weights")
    if not statics:
        raise refuse(f"{field}.input_activations", None,
                      "weight-only fp8 (W8A16) is not implemented")
    return CheckpointQuant("compressed-tensors", "channel", statics[0],
                           names(qc.get("ignore"), "ignore"))


def checkpoint_quant(d: dict[str, Any]) -> CheckpointQuant | None:
    """The format of a pre-quantized checkpoint's config.json, None for an unquantized one; any
    setting not implemented raises, naming it."""
    qc = d.get("quantization_config") or d.get("compression_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise refuse("quant_method", qc, "unrecognised quantization_config")
    method = qc.get("quant_method", "?")
    if (w4 := w4_format(qc)) is not None:  # AWQ, GPTQ, compressed-tensors pack-quantized
        return CheckpointQuant(method, "w4", False, w4[1], w4[0])
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "mxfp4":  # gpt-oss's experts (quant/mxfp4.py)
        return CheckpointQuant("mxfp4", "mxfp4", False, *_mxfp4_config(qc))
    raise refuse("quant_method", method, "pre-quantized checkpoints load as fp8, "
                  "compressed-tensors (float-, int-, pack-quantized), awq, gptq or mxfp4; use the "
                  "bf16/fp16 checkpoint (optionally with --quantization fp8)")
