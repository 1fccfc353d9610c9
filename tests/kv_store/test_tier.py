"""An engine's view of the KV store: it finds the newest store of its server, copies blocks
between its pool and the store, and lets go of a store whose owner removed it."""

from __future__ import annotations

import os
import uuid

import torch

from python_backends.kv_store.host_store import HostKVStore, find_store, store_name
from python_backends.kv_store.tier import StoreTier
from python_backends.kv_transfer.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32",
                  num_blocks=8)
SERVER = 2**22 + int(uuid.uuid4().int % 1000)  # above any real pid: no real server's stores


def test_find_store_picks_the_newest_of_the_server() -> None:
    assert find_store(SERVER) is None
    old = HostKVStore.create(store_name(SERVER, 1), LAYOUT)
    new = HostKVStore.create(store_name(SERVER, 2), LAYOUT)
    os.utime(old._index_path, (1, 1))
    try:
        assert find_store(SERVER) == new.name
    finally:
        old.close()
        new.close()
    assert find_store(SERVER) is None


def test_blocks_round_trip_and_a_removed_store_is_let_go() -> None:
    pool = torch.arange(2 * 2 * 32 * 2 * 4, dtype=torch.float32).reshape(2, 2, 32, 2, 4)
    layout = KVLayout(2, 2, 4, 4, "float32", num_blocks=8)
    tier = StoreTier(lambda: find_store(SERVER), pool, layout, retry_s=0.0)
    assert not tier.contains(5)  # no store yet: a miss, not a wait
    store = HostKVStore.create(store_name(SERVER, 3), LAYOUT)
    try:
        tier.write(5, (1, 2, 3, 4), 2)
        assert tier.contains(5) and tier.bytes_written == layout.bytes_for(1)
        assert tier.read(5, (1, 2, 3, 4), 6)
        assert torch.equal(pool[:, :, 24:28], pool[:, :, 8:12])
    finally:
        store.close()
    assert not tier.contains(5) and tier.store is None
    tier.close()


def test_a_store_of_another_layout_is_not_used() -> None:
    other = HostKVStore.create(store_name(SERVER, 4),
                               KVLayout(2, 2, 8, 4, "float32", num_blocks=8))
    try:
        pool = torch.zeros(2, 2, 32, 2, 4)
        tier = StoreTier(lambda: other.name, pool, KVLayout(2, 2, 4, 4, "float32", 8))
        assert tier.store is None and not tier.contains(1)
    finally:
        other.close()
