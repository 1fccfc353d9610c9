"""An engine's view of the node's KV store: blocks copied between its pool and the store.

The store model may start after the engines, or be reloaded (a new store replaces the old), so
the tier looks for the store lazily and checks, every few seconds, that the one it uses is
still there; while no store is there, or its layout does not match the engine's, every lookup
misses and every write is skipped: the engine computes, it never waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from python_backends.kv_store.host_store import HostKVStore
from python_backends.kv_transfer.layout import KVLayout

log = logging.getLogger(__name__)
RETRY_S = 5.0  # between attempts to attach a store that is not there


class StoreTier:
    def __init__(self, find: Callable[[], str | None], pool: torch.Tensor, layout: KVLayout,
                 retry_s: float = RETRY_S) -> None:
        """`find`: the name of the store to use, None while there is none. `pool`: the engine's
        KV pool (the whole model's layout, `layout`)."""
        self._find = find
        self._pool = pool
        self._layout = layout
        self._retry_s = retry_s
        self._store: HostKVStore | None = None
        self._refused: set[str] = set()  # stores whose layout differs
        self._next_check = 0.0
        self._block_bytes = layout.bytes_for(1)
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def store(self) -> HostKVStore | None:
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + self._retry_s
            if self._store is not None and not self._store.exists():
                log.info("KV store %s is gone", self._store.name)
                self.close()
            if self._store is None:
                self._store = self._attach()
        return self._store

    def _attach(self) -> HostKVStore | None:
        name = self._find()
        if name is None or name in self._refused:
            return None
        try:
            store = HostKVStore.attach(name)
        except (FileNotFoundError, ValueError):
            return None
        problem = store.layout.incompatibility(self._layout)
        if problem is not None:
            log.warning("KV store %s does not match this engine (%s); not using it", name,
                        problem)
            store.close()
            self._refused.add(name)
            return None
        log.info("attached KV store %s (%d blocks)", name, store.num_slots)
        return store

    def _block(self, block: int) -> torch.Tensor:
        bs = self._layout.block_size
        return self._pool[:, :, block * bs:(block + 1) * bs]

    def contains(self, key: int) -> bool:
        store = self.store
        return store is not None and store.contains(key)

    def read(self, key: int, tokens: tuple[int, ...], block: int) -> bool:
        store = self.store
        if store is None or not store.read(key, tokens, self._block(block)):
            return False
        self.bytes_read += self._block_bytes
        return True

    def write(self, key: int, tokens: tuple[int, ...], block: int) -> None:
        store = self.store
        if store is not None and store.write(key, tokens, self._block(block)):
            self.bytes_written += self._block_bytes

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
