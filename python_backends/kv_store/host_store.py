"""The node's host-memory KV tier: full KV blocks by chained hash, shared by every engine
instance of a server through POSIX shared memory.

Two files in /dev/shm: the data, a KV pool of `num_slots` one-block slots (kv_transfer's
SharedPool, so a slot is copied like any block), and an index beside it (per slot: hash, token
ids, version, last use). Writers serialize on a file lock to pick a slot (an empty one, else the
least recently used) and bump its version to odd while they copy, to even when done. Readers
take no lock: they copy and then check that the version did not move (a seqlock), so an entry
is never used while it is being written and a reader that dies holds nothing. A store that is
full of entries being written, or gone, only makes engines compute.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from python_backends.flag_board import SHM_DIR, map_shared
from python_backends.kv_transfer.host_shm import NAME_PREFIX, SharedPool
from python_backends.kv_transfer.layout import KVLayout

STORE_PREFIX = f"{NAME_PREFIX}store_"
_MAGIC = b"LLMKVSTORE1"
_HEADER = 4096  # magic, then the layout as JSON
STALE_WRITE_S = 30.0  # a slot odd for this long lost its writer: reclaimable


def store_name(server_pid: int, owner_pid: int) -> str:
    """A store of the Triton server with pid `server_pid` (every stub's parent), made by the
    stub `owner_pid`: unique, so a reloaded kv_store model never meets its predecessor's."""
    return f"{STORE_PREFIX}{server_pid}_{owner_pid}"


def find_store(server_pid: int) -> str | None:
    """The newest store of that server, if any."""
    prefix, suffix = f"{STORE_PREFIX}{server_pid}_", "_index"
    found = []
    for path in SHM_DIR.glob(f"{prefix}*{suffix}"):
        with contextlib.suppress(FileNotFoundError):
            found.append((path.stat().st_mtime, path.name[:-len(suffix)]))
    return max(found)[1] if found else None


@dataclass(frozen=True)
class StoreStats:
    num_slots: int
    num_ready: int
    num_evictions: int

    @property
    def usage(self) -> float:
        return self.num_ready / self.num_slots


class HostKVStore:
    def __init__(self, name: str, layout: KVLayout, owner: bool) -> None:
        """`layout`: the data pool's, `num_blocks` being the slots. Use `create` or `attach`."""
        self.name = name
        self.layout = layout
        self.num_slots = n = layout.num_blocks
        bs = layout.block_size
        self._index_path = SHM_DIR / f"{name}_index"
        self._pool = (SharedPool.create(layout, name) if owner
                      else SharedPool.attach(name, layout))
        size = _HEADER + n * (8 + 8 + 8 + 4 * bs) + 8
        self._map = map_shared(self._index_path, size, owner)
        self._lock_fd = os.open(self._index_path, os.O_RDWR)
        self._thread_lock = threading.Lock()
        buf = memoryview(self._map)[_HEADER:]
        self._keys = np.frombuffer(buf, np.uint64, n, 0)
        self._versions = np.frombuffer(buf, np.uint64, n, 8 * n)
        self._last_used = np.frombuffer(buf, np.float64, n, 16 * n)
        self._tokens = np.frombuffer(buf, np.int32, n * bs, 24 * n).reshape(n, bs)
        self._evictions = np.frombuffer(buf, np.uint64, 1, (24 + 4 * bs) * n)
        if owner:
            header = _MAGIC + json.dumps(layout.to_dict()).encode()
            self._map[:len(header)] = header
        self.data = self._pool.tensor  # [layers, 2, slots * block_size, kv heads, head dim]
        self._owner = owner

    @classmethod
    def create(cls, name: str, layout: KVLayout) -> HostKVStore:
        return cls(name, layout, owner=True)

    @classmethod
    def attach(cls, name: str) -> HostKVStore:
        """The store called `name`; FileNotFoundError while it does not exist."""
        with open(SHM_DIR / f"{name}_index", "rb") as f:
            header = f.read(_HEADER)
        if not header.startswith(_MAGIC):
            raise ValueError(f"{name} is not a KV store")
        layout = KVLayout.from_dict(json.loads(header[len(_MAGIC):].rstrip(b"\0")))
        return cls(name, layout, owner=False)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _find(self, key: int) -> int | None:
        (slots,) = np.nonzero(self._keys == np.uint64(key))
        for s in slots:
            v = int(self._versions[s])
            if v and v % 2 == 0:
                return int(s)
        return None

    def _slot_view(self, slot: int) -> torch.Tensor:
        bs = self.layout.block_size
        return self.data[:, :, slot * bs:(slot + 1) * bs]

    def exists(self) -> bool:
        """Whether the store's files are still there (its owner removes them when it goes)."""
        return self._index_path.exists()

    def contains(self, key: int) -> bool:
        return self._find(key) is not None

    def read(self, key: int, tokens: tuple[int, ...], dst: torch.Tensor) -> bool:
        """Copy the entry for `key` (its token ids confirmed) into `dst`, one block of a pool
        of this layout; False if it is absent, or was written meanwhile (`dst` then holds
        garbage the caller computes over)."""
        slot = self._find(key)
        if slot is None:
            return False
        before = int(self._versions[slot])
        if before % 2 or tuple(self._tokens[slot].tolist()) != tokens:
            return False
        dst.copy_(self._slot_view(slot))
        if int(self._versions[slot]) != before or int(self._keys[slot]) != key:
            return False
        self._last_used[slot] = time.monotonic()
        return True

    def write(self, key: int, tokens: tuple[int, ...], src: torch.Tensor) -> bool:
        """Store `src` (one block) under `key` unless it is there already; False when every
        slot is being written (the write is skipped)."""
        with self._locked():
            present = self._find(key)
            if present is not None:
                self._last_used[present] = time.monotonic()
                return True
            slot = self._victim()
            if slot is None:
                return False
            version = int(self._versions[slot])
            if version and version % 2 == 0:  # a stored entry goes
                self._evictions[0] += np.uint64(1)
            # Odd while this writer copies (a stale writer's slot stays odd: one more turn).
            self._versions[slot] = np.uint64(version + 1 if version % 2 == 0 else version + 2)
            self._keys[slot] = np.uint64(key)
            self._tokens[slot] = tokens
            self._last_used[slot] = time.monotonic()
        self._slot_view(slot).copy_(src)
        with self._locked():
            self._versions[slot] += np.uint64(1)
            self._last_used[slot] = time.monotonic()
        return True

    def _victim(self) -> int | None:
        """An empty slot, else the least recently used stable one, else one whose writer is
        long gone (under the lock)."""
        (empty,) = np.nonzero(self._versions == 0)
        if len(empty):
            return int(empty[0])
        writing = (self._versions % 2).astype(bool)
        stale = writing & (self._last_used < time.monotonic() - STALE_WRITE_S)
        candidates = np.nonzero(~writing | stale)[0]
        if not len(candidates):
            return None
        return int(candidates[np.argmin(self._last_used[candidates])])

    def stats(self) -> StoreStats:
        v = self._versions
        return StoreStats(self.num_slots, int(np.count_nonzero((v > 0) & (v % 2 == 0))),
                          int(self._evictions[0]))

    def close(self) -> None:
        """Unmap; the owner also removes the files (attached readers keep their mappings)."""
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)
        del self._keys, self._versions, self._last_used, self._evictions, self._tokens
        with contextlib.suppress(BufferError):
            self._map.close()
        self._pool.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                Path(self._index_path).unlink()
