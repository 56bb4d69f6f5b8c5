"""Reading checkpoint tensors, or only this rank's part of them.

A weight source is either a torch.Tensor or a safetensors slice (`safe_open(...).get_slice(n)`):
both index with Python slices, and a slice reads only the bytes asked for, so a TP rank never
materialises the full tensor. Every parameter carries `weight_loader(param, src, shard_id)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

WeightSource = Any  # torch.Tensor | safetensors PySafeSlice
Loader = Callable[[torch.nn.Parameter, WeightSource, Any], None]


def src_shape(src: WeightSource) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def read(src: WeightSource, dim: int | None = None, start: int = 0,
         length: int | None = None) -> torch.Tensor:
    """The whole tensor, or `length` entries of dimension `dim` from `start`."""
    shape = src_shape(src)
    if dim is None:
        index: tuple[slice, ...] = tuple(slice(None) for _ in shape)
    else:
        stop = shape[dim] if length is None else start + length
        index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))
    out = src[index]
    return out if isinstance(out, torch.Tensor) else torch.as_tensor(out)


def check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(got)}, expected "
                         f"{tuple(want)} (config.json and weights disagree)")


def default_loader(param: torch.nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
    """A replicated parameter: the whole tensor, same shape."""
    check_shape("a replicated parameter", src_shape(src), tuple(param.shape))
    param.data.copy_(read(src))


def set_loader(param: torch.nn.Parameter, loader: Loader,
               num_shards: int = 1) -> torch.nn.Parameter:
    """`num_shards`: how many checkpoint tensors (distinct shard ids) fill this parameter."""
    # Attributes of our own on torch's Parameter, read by the loader.
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.num_shards = num_shards  # type: ignore[attr-defined]
    return param


def new_param(*shape: int) -> torch.nn.Parameter:
    """Uninitialised; the loader (or the dummy initialiser) fills it. Device and dtype come from
    the torch defaults the model is built under."""
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)
