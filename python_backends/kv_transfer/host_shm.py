"""`host_shm`: same node, CPU. The owner's pool lives in POSIX shared memory; the puller maps it
and copies the blocks' byte ranges directly. Releases go through the owner's release board."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from python_backends.flag_board import SHM_DIR, BoardCache
from python_backends.kv_transfer.base import (
    Failure,
    KVHandle,
    KVSink,
    KVSource,
    TransferError,
    node_id,
)
from python_backends.kv_transfer.layout import KVLayout, allocate_pool, byte_ranges

NAME_PREFIX = "triton_llm_kv_"  # the launcher sweeps triton* regions left by a killed server


class SharedPool:
    """A pool tensor backed by a shared-memory file (owner) or a mapping of one (puller)."""

    def __init__(self, path: Path, layout: KVLayout, owner: bool) -> None:
        self.path = path
        self.layout = layout
        self._owner = owner
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0), 0o600)
        try:
            if owner:
                os.ftruncate(fd, layout.nbytes)
            # Populate: map every page now, not at first touch; a pull that faulted in fresh
            # 4 KiB pages (shared memory gets no huge pages here) ran at half speed.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, layout.nbytes, flags=flags)
        finally:
            os.close(fd)
        self.tensor = allocate_pool(layout, self._map)

    @classmethod
    def create(cls, layout: KVLayout, name: str | None = None) -> SharedPool:
        """A new pool; `name` (default: unique to this process) must start with NAME_PREFIX."""
        name = name or f"{NAME_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}"
        if not name.startswith(NAME_PREFIX):
            raise ValueError(f"a KV pool's name starts with {NAME_PREFIX}: {name!r}")
        return cls(SHM_DIR / name, layout, True)

    @classmethod
    def attach(cls, name: str, layout: KVLayout) -> SharedPool:
        path = SHM_DIR / name
        if not name.startswith(NAME_PREFIX) or path.parent != SHM_DIR:
            raise ValueError(f"not a KV pool: {name!r}")
        if path.stat().st_size != layout.nbytes:
            raise ValueError(f"KV pool {name} is {path.stat().st_size} bytes, not "
                             f"{layout.nbytes}")
        return cls(path, layout, False)

    @property
    def name(self) -> str:
        return self.path.name

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):  # a view still lives; the mapping goes with it
            self._map.close()
        if self._owner:
            self.path.unlink(missing_ok=True)


class HostShmSource(KVSource):
    kind = "host_shm"

    def __init__(self, pool_name: str) -> None:
        """`pool_name`: the SharedPool holding the owner's KV pool."""
        self.pool_name = pool_name

    def location(self) -> dict[str, Any]:
        return {"shm": self.pool_name, "node": node_id()}


class HostShmSink(KVSink):
    kind = "host_shm"
    same_node = True

    def __init__(self, layout: KVLayout, pool: torch.Tensor, boards: BoardCache) -> None:
        super().__init__(layout, boards)
        self._dst = pool.view(-1).view(torch.uint8)
        self._owner_pools: dict[str, SharedPool] = {}
        self._lock = threading.Lock()

    def _owner_pool(self, handle: KVHandle) -> SharedPool:
        name = handle.location["shm"]
        with self._lock:
            pool = self._owner_pools.get(name)
            if pool is None:
                try:
                    pool = self._owner_pools[name] = SharedPool.attach(name, handle.layout)
                except (OSError, ValueError) as e:
                    raise TransferError(Failure.ERROR, f"cannot map KV pool: {e}") from None
            return pool

    def _copy(self, handle: KVHandle, dst_blocks: list[int]) -> None:
        src = self._owner_pool(handle).tensor.data_ptr()
        dst = self._dst.data_ptr()
        ranges = byte_ranges(handle.layout, self.layout, list(handle.block_ids), dst_blocks)
        # libc memmove on one thread: torch's parallel copy stalls at its thread barrier when a
        # core is busy elsewhere (the engine loop, the prefill instance), as on small machines.
        for s, d, n in ranges.tolist():
            ctypes.memmove(dst + d, src + s, n)
        self.release_on_board(handle)

    def close(self) -> None:
        with self._lock:
            for pool in self._owner_pools.values():
                pool.close()
            self._owner_pools.clear()
