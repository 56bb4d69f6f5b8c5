"""The checks every quantization_config parser shares (prequant.py for fp8, quant/'s parsers for
the other formats): the one-line refusal, module-name lists, QuantizationArgs against the values
implemented, and compressed-tensors' top level down to its one quantization group."""

from __future__ import annotations

from typing import Any

UNSET = (None,)  # an argument that must be absent or null
# compressed-tensors' top-level keys without arithmetic (provenance, statistics, `ignore`: the
# layers left unquantized, read by the callers) and those that must be empty
CT_INERT = ("quant_method", "format", "config_groups", "ignore", "global_compression_ratio",
            "version", "provider", "quantization_status")
CT_EMPTY = ("kv_cache_scheme", "sparsity_config", "transform_config")


def refuse(field: str, value: object, why: str) -> ValueError:
    """The start-up error for a setting not implemented: one line naming field and value."""
    return ValueError(f"config.json quantization_config.{field}={value!r} is not supported: {why}")


def names(v: object, field: str) -> tuple[str, ...]:
    """A list of module names (ignore lists), () when absent."""
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise refuse(field, v, "expected a list of module names")
    return tuple(v)


def check_args(args: dict[str, Any], field: str, want: dict[str, tuple[object, ...]],
               inert: tuple[str, ...]) -> None:
    """QuantizationArgs: each key in `inert` or `want`, each value among want's."""
    for key, value in args.items():
        if key in inert:
            continue
        allowed = want.get(key)
        if allowed is None:
            raise refuse(f"{field}.{key}", value, "a quantization argument not implemented")
        if value not in allowed:
            raise refuse(f"{field}.{key}", value, f"supported: {', '.join(map(repr, allowed))}")


def compressed_group(qc: dict[str, Any], empty_why: str) -> tuple[str, dict[str, Any]]:
    """A compressed-tensors config's top level checked (known keys, the empty ones empty, a
    compressed checkpoint, exactly one group): (the group's field name, the group)."""
    for key, value in qc.items():
        if key in CT_EMPTY:
            if value:
                raise refuse(key, value, empty_why)
        elif key not in CT_INERT:
            raise refuse(key, value, "a compressed-tensors setting not implemented")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse("quantization_status", status, "only compressed checkpoints load")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse("config_groups", sorted(groups), "exactly one quantization group loads")
    name, group = next(iter(groups.items()))
    return f"config_groups.{name}", group
