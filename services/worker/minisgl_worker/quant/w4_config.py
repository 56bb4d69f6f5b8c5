"""The config.json side of 4-bit (W4A16) checkpoints: AWQ (GEMM packing), GPTQ (v1 / v2) and
compressed-tensors pack-quantized, parsed whole before any weight is read. Every key is either
implemented, or known to carry no arithmetic (calibration settings, provenance), or refused in one
line naming it (never serve wrong). The tensors' layouts are read by quant_load/w4_layouts.py.

    AWQ   quant_method "awq", version/format "gemm", bits (w_bit) 4, group_size (q_group_size)
          32/64/128, zero_point true: AutoAWQ's GEMM packer stores zero points always (it
          asserts them), so zero_point false describes no GEMM checkpoint it writes.
    GPTQ  quant_method "gptq", bits 4, group_size 32/64/128/-1 (per channel), desc_act
          (act-order: g_idx groups the input features out of order), sym, checkpoint_format
          (or format) "gptq" (v1: stored zero points are z - 1) or "gptq_v2" (z as is).
    CT    compressed-tensors, format "pack-quantized", one group targeting Linear: weights
          num_bits 4, type int, strategy group (32/64/128) or channel, symmetric or not, static,
          actorder null/"weight" (groups stay in order: nothing stored) or "group" (weight_g_idx
          stored), no input activations (W4A16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config_checks import compressed_group, names, refuse
from .w4a16 import GROUP_SIZES

Parsed = tuple["W4Format", tuple[str, ...]]  # the settings, and the modules left unquantized


@dataclass(frozen=True)
class W4Format:
    """A 4-bit checkpoint's settings (prequant.CheckpointQuant.details, scheme "w4")."""

    layout: str  # "awq" | "gptq" | "ct": which tensor names and packing (w4_layouts.py)
    group_size: int  # inputs per scale; -1: one group per output channel (G = K)
    symmetric: bool  # configured symmetric (the zero points in the tensors decide the math)
    act_order: bool  # g_idx may group input features out of order (GPTQ desc_act, CT "group")
    zero_offset: int = 0  # added to stored zero points: 1 for GPTQ v1 (it stores z - 1)

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        zeros = "symmetric" if self.symmetric else "zero points"
        order = ", act-order g_idx" if self.act_order else ""
        return f"{self.layout} W4A16: 4-bit weights, {group} scales, {zeros}{order}"


# Keys that describe how a checkpoint was calibrated or which tool wrote it, never what a stored
# tensor means (the tensors themselves say which modules are quantized).
_GPTQ_INERT = frozenset((
    "quant_method", "damp_percent", "damp_auto_increment", "true_sequential", "static_groups",
    "model_name_or_path", "model_file_base_name", "meta", "mse", "act_group_aware", "hyb_act",
    "v2", "v2_alpha", "tokenizer", "dataset", "model_seqlen", "block_name_to_quantize",
    "module_name_preceding_first_block", "batch_size", "pad_token_id", "max_input_length",
    "cache_block_outputs", "modules_in_block_to_quantize", "backend", "use_cuda_fp16",
    "use_exllama", "exllama_config", "disable_exllama", "modules_to_not_convert"))
_AWQ_INERT = _GPTQ_INERT | {"do_fuse", "fuse_max_seq_len", "modules_to_fuse", "sym"}
_UNSET: tuple[object, ...] = (None, False, {}, [])  # values of an arithmetic key that mean "not used"


def _pick(qc: dict[str, Any], *names: str) -> tuple[str, Any]:
    """(the key present, its value) of a setting spelled several ways; the first if none."""
    for name in names:
        if name in qc:
            return name, qc[name]
    return names[0], None


def _bits(qc: dict[str, Any], *names: str) -> None:
    key, bits = _pick(qc, *names)
    if bits != 4:
        raise refuse(key, bits, "only 4-bit weights load (W4A16)")


def _group(key: str, g: object, per_channel_ok: bool) -> int:
    if g in GROUP_SIZES or (per_channel_ok and g == -1):
        assert isinstance(g, int)
        return g
    allowed = ", ".join(map(str, GROUP_SIZES)) + (" or -1 (per channel)" if per_channel_ok else "")
    raise refuse(key, g, f"group sizes {allowed} load")


def _check_keys(qc: dict[str, Any], known: frozenset[str] | set[str], what: str) -> None:
    for key, value in qc.items():
        if key not in known:
            raise refuse(key, value, f"a {what} setting this engine does not implement")


def _awq(qc: dict[str, Any]) -> Parsed:
    known = _AWQ_INERT | {"bits", "w_bit", "group_size", "q_group_size", "zero_point",
                          "version", "format", "desc_act", "checkpoint_format"}
    _check_keys(qc, known, "AWQ")
    _bits(qc, "bits", "w_bit")
    key, version = _pick(qc, "version", "format")
    if str(version).lower() != "gemm":
        raise refuse(key, version, "only AWQ's GEMM packing loads (gemv, gemv_fast, exllama, "
                      "marlin and ipex pack the tensors differently)")
    key, g = _pick(qc, "group_size", "q_group_size")
    group = _group(key, g if g is not None else 128, per_channel_ok=False)
    if qc.get("zero_point", True) is not True:
        raise refuse("zero_point", qc["zero_point"], "AutoAWQ's GEMM checkpoints always store "
                      "zero points (qzeros)")
    if qc.get("desc_act") not in _UNSET:
        raise refuse("desc_act", qc["desc_act"], "AWQ has no act-order")
    fmt = W4Format("awq", group, symmetric=False, act_order=False)
    return fmt, names(qc.get("modules_to_not_convert"), "modules_to_not_convert")


def _gptq(qc: dict[str, Any]) -> Parsed:
    known = _GPTQ_INERT | {"bits", "group_size", "desc_act", "sym", "checkpoint_format",
                           "format", "pack_dtype", "lm_head", "dynamic", "adapter", "rotation",
                           "is_marlin_format"}
    _check_keys(qc, known, "GPTQ")
    _bits(qc, "bits")
    group = _group("group_size", qc.get("group_size", 128), per_channel_ok=True)
    key, fmt = _pick(qc, "checkpoint_format", "format")
    fmt = "gptq" if fmt is None else str(fmt).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(key, fmt, "only the gptq (v1) and gptq_v2 packings load")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise refuse("pack_dtype", qc["pack_dtype"], "only int32 packing loads")
    for arith in ("lm_head", "dynamic", "adapter", "rotation", "is_marlin_format"):
        if qc.get(arith) not in _UNSET:
            raise refuse(arith, qc[arith], "changes the computation; not implemented")
    for flag in ("desc_act", "sym"):
        if qc.get(flag) is not None and not isinstance(qc[flag], bool):
            raise refuse(flag, qc[flag], "expected true or false")
    details = W4Format("gptq", group, symmetric=qc.get("sym", True) is True,
                       act_order=qc.get("desc_act", False) is True,
                       zero_offset=1 if fmt == "gptq" else 0)
    return details, names(qc.get("modules_to_not_convert"), "modules_to_not_convert")


_ACTORDER = {None: False, False: False, "weight": False, "static": False, True: True,
             "group": True, "dynamic": True}


def _ct_weights(args: dict[str, Any], field: str) -> W4Format:
    for key, value in args.items():
        want: tuple[object, ...] | None = {
            "num_bits": (4,), "type": ("int",), "symmetric": (True, False),
            "strategy": ("group", "channel"), "dynamic": (False,), "block_structure": (None,),
        }.get(key)
        if key in ("observer", "observer_kwargs", "scale_dtype", "zp_dtype", "group_size"):
            continue  # calibration / storage dtypes (the tensors carry theirs); size: below
        if key == "actorder":
            if not isinstance(value, str | bool | None) or value not in _ACTORDER:
                raise refuse(f"{field}.actorder", value, "supported: null, 'weight', 'group'")
            continue
        if want is None:
            raise refuse(f"{field}.{key}", value, "a quantization argument not implemented")
        if value not in want:
            raise refuse(f"{field}.{key}", value, f"supported: {', '.join(map(repr, want))}")
    if args.get("num_bits") != 4:
        raise refuse(f"{field}.num_bits", args.get("num_bits"), "only 4-bit weights load")
    strategy = args.get("strategy")
    if strategy == "channel":
        if args.get("group_size") not in (None, -1):
            raise refuse(f"{field}.group_size", args["group_size"], "channel strategy")
        group = -1
    elif strategy == "group":
        group = _group(f"{field}.group_size", args.get("group_size"), per_channel_ok=False)
    else:
        raise refuse(f"{field}.strategy", strategy, "supported: 'group', 'channel'")
    act = _ACTORDER[args.get("actorder")]
    return W4Format("ct", group, symmetric=args.get("symmetric", True) is True, act_order=act)


def _ct_pack(qc: dict[str, Any]) -> Parsed:
    field, group = compressed_group(qc, "not implemented (only weights)")
    fmt: W4Format | None = None
    for key, value in group.items():
        if key == "targets" and value != ["Linear"]:
            raise refuse(f"{field}.targets", value, "only ['Linear'] loads")
        if key == "format" and value not in (None, "pack-quantized"):
            raise refuse(f"{field}.format", value, "only pack-quantized loads here")
        if key in ("input_activations", "output_activations") and value is not None:
            raise refuse(f"{field}.{key}", value, "pack-quantized loads weight-only (W4A16)")
        if key == "weights":
            fmt = _ct_weights(value or {}, f"{field}.weights")
        elif key not in ("targets", "format", "input_activations", "output_activations"):
            raise refuse(f"{field}.{key}", value, "a quantization group setting not implemented")
    if fmt is None:
        raise refuse(f"{field}.weights", None, "a group without weights")
    return fmt, names(qc.get("ignore"), "ignore")


def w4_format(qc: dict[str, Any]) -> Parsed | None:
    """The settings (and ignored modules) of an AWQ / GPTQ / compressed-tensors pack-quantized
    config; None for any other quant_method or compressed-tensors format (other parsers)."""
    method = qc.get("quant_method")
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
        return _ct_pack(qc)
    return None
