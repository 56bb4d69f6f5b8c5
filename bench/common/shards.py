"""Writing a synthetic checkpoint as safetensors shards with an index, tensor by tensor (the
bench.common.*_dir writers): a shard closes before it would pass `shard_bytes`, so host memory
holds at most one shard of tensors at a time."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SHARD_BYTES = 4 << 30


class ShardWriter:
    def __init__(self, out: Path, shard_bytes: int = SHARD_BYTES) -> None:
        self.out, self.shard_bytes = out, shard_bytes
        self.shard: dict[str, torch.Tensor] = {}
        self.weight_map: dict[str, str] = {}
        self.shards = self.size = self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.size + nbytes > self.shard_bytes:
            self._flush()
        self.shard[name] = t
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self.shard:
            self.shards += 1
            name = f"model-{self.shards:05d}.safetensors"
            save_file({k: v.cpu().contiguous() for k, v in self.shard.items()},
                      str(self.out / name), metadata={"format": "pt"})
            self.weight_map.update(dict.fromkeys(self.shard, name))
        self.shard, self.size = {}, 0

    def close(self) -> None:
        """The last shard and the index (model.safetensors.index.json)."""
        self._flush()
        (self.out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, indent=1))
