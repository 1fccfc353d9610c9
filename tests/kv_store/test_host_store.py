"""The host-memory KV store: entries by hash, confirmed by token ids, its own LRU, readers that
never take a half-written entry, and several processes sharing one store."""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Iterator

import pytest
import torch

from python_backends.kv_store.host_store import STORE_PREFIX, HostKVStore
from python_backends.kv_transfer.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32",
                  num_blocks=3)


@pytest.fixture
def store() -> Iterator[HostKVStore]:
    s = HostKVStore.create(f"{STORE_PREFIX}test_{uuid.uuid4().hex[:8]}", LAYOUT)
    yield s
    s.close()


def block(value: float) -> torch.Tensor:
    return torch.full((2, 2, 4, 2, 4), value)


def test_write_read_and_token_confirmation(store: HostKVStore) -> None:
    assert store.write(11, (1, 2, 3, 4), block(1.0))
    out = torch.zeros(2, 2, 4, 2, 4)
    assert store.contains(11) and store.read(11, (1, 2, 3, 4), out)
    assert torch.equal(out, block(1.0))
    assert not store.read(11, (1, 2, 3, 5), out)  # same hash, other tokens: a miss
    assert not store.read(12, (1, 2, 3, 4), out) and not store.contains(12)


def test_lru_eviction(store: HostKVStore) -> None:
    for key in (1, 2, 3):
        store.write(key, (key,) * 4, block(float(key)))
    out = torch.zeros(2, 2, 4, 2, 4)
    assert store.read(1, (1,) * 4, out)  # 1 is now more recent than 2
    store.write(4, (4,) * 4, block(4.0))  # evicts 2, the least recently used
    assert store.contains(1) and not store.contains(2) and store.contains(3)
    stats = store.stats()
    assert stats.num_ready == 3 and stats.num_evictions == 1 and stats.usage == 1.0


def test_an_entry_being_written_is_never_read(store: HostKVStore) -> None:
    store.write(7, (7,) * 4, block(7.0))
    slot = store._find(7)
    assert slot is not None
    store._versions[slot] += 1  # as a writer does before it copies
    out = torch.zeros(2, 2, 4, 2, 4)
    assert not store.contains(7) and not store.read(7, (7,) * 4, out)


def _attach_and_write(name: str, key: int) -> None:
    other = HostKVStore.attach(name)
    other.write(key, (key,) * 4, block(float(key)))
    other.close()


def test_processes_share_one_store(store: HostKVStore) -> None:
    proc = multiprocessing.get_context("fork").Process(
        target=_attach_and_write, args=(store.name, 42))
    proc.start()
    proc.join(30)
    out = torch.zeros(2, 2, 4, 2, 4)
    assert proc.exitcode == 0 and store.read(42, (42,) * 4, out)
    assert torch.equal(out, block(42.0))


def test_absent_store_is_not_found() -> None:
    with pytest.raises(FileNotFoundError):
        HostKVStore.attach(f"{STORE_PREFIX}absent")
