"""The KV pool of one engine instance and the byte ranges a block list occupies in it.

The pool is one contiguous tensor `[layers, planes, slots, kv_heads, head_dim]`, so a
transport registers or maps it once: two planes (K, V) per layer, or one where the model caches a
latent vector per token instead (multi-head latent attention: one "head" holding the compressed
KV and the rotated key part). Block `b` of layer `l` holds slots
`[b * block_size, (b + 1) * block_size)`: `planes * layers` contiguous ranges per block, and runs
of consecutive blocks merge into longer ranges.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from python_backends.config import DTYPE_BYTES

if TYPE_CHECKING:  # torch only where a pool is allocated: the front's stub reads layouts
    import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV pool: what a receiver must match to use the sender's bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_blocks: int
    tp_rank: int = 0
    tp_size: int = 1
    planes: int = 2  # K and V; 1: a latent cache (models.latent_attention)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.planes, self.num_blocks * self.block_size,
                self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def block_range_bytes(self) -> int:
        """Bytes of one block in one (layer, plane) plane."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def plane_bytes(self) -> int:
        return self.num_blocks * self.block_range_bytes

    @property
    def nbytes(self) -> int:
        return self.planes * self.num_layers * self.plane_bytes

    def bytes_for(self, num_blocks: int) -> int:
        return self.planes * self.num_layers * num_blocks * self.block_range_bytes

    def incompatibility(self, other: KVLayout) -> str | None:
        """Why blocks of `other` cannot be copied into this layout as they are, if they can't."""
        for name in ("num_layers", "planes", "num_kv_heads", "head_dim", "block_size", "dtype",
                     "tp_size"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} differs ({getattr(other, name)} vs {getattr(self, name)})"
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(**d)


def allocate_pool(layout: KVLayout, buffer: Any = None,
                  device: torch.device | None = None) -> torch.Tensor:
    """A zeroed pool tensor: on `device` when that is not the CPU (one allocation there), else
    in `buffer` (a writable buffer of `layout.nbytes`) if given, else in anonymous memory on
    transparent huge pages where the kernel allows (host_memory): pulls over NIXL (UCX's
    cross-process copy) ran 2-3x faster from and into huge pages, and attention's gathers miss
    the TLB less."""
    import torch

    from python_backends.host_memory import huge_page_empty

    if device is not None and device.type != "cpu":
        if buffer is not None:
            raise ValueError(f"a KV pool on {device} cannot live in a host buffer")
        return torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device)
    numel = layout.nbytes // layout.torch_dtype.itemsize
    if buffer is not None:
        return torch.frombuffer(buffer, dtype=layout.torch_dtype, count=numel).view(layout.shape)
    flat = huge_page_empty(numel, layout.torch_dtype)
    flat.zero_()  # fault every page in now: a pull into untouched pages ran 5-10x slower
    return flat.view(layout.shape)


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """Pair source and destination blocks into runs `(src_start, dst_start, length)` that are
    consecutive on both sides."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def byte_ranges(
    src: KVLayout, dst: KVLayout, src_blocks: list[int], dst_blocks: list[int]
) -> np.ndarray:
    """`[N, 3]` int64 rows `(src_offset, dst_offset, length)`: the copies that move the blocks,
    one per (layer, plane, run)."""
    runs = np.array(block_runs(src_blocks, dst_blocks), dtype=np.int64).reshape(-1, 3)
    unit = src.block_range_bytes
    planes = np.arange(src.planes * src.num_layers, dtype=np.int64)[:, None]  # [P, 1]
    out = np.empty((planes.shape[0], runs.shape[0], 3), dtype=np.int64)
    out[:, :, 0] = planes * src.plane_bytes + runs[None, :, 0] * unit
    out[:, :, 1] = planes * dst.plane_bytes + runs[None, :, 1] * unit
    out[:, :, 2] = runs[None, :, 2] * unit
    return out.reshape(-1, 3)
