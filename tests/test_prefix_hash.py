"""python_backends.prefix_hash: one block identity for engines and the gateway."""

from __future__ import annotations

from python_backends.prefix_hash import block_hash, prefix_hashes


def test_prefix_hashes_are_chained_salted_and_cover_full_blocks_only() -> None:
    ids = list(range(40))
    hashes = prefix_hashes(ids, 16, "s")
    assert len(hashes) == 2
    assert hashes[0] == block_hash(None, ids[:16], "s")
    assert hashes[1] == block_hash(hashes[0], ids[16:32], "s")
    assert prefix_hashes(ids, 16, "other")[0] != hashes[0]
    changed = [99, *ids[1:]]
    assert prefix_hashes(changed, 16, "s")[1] != hashes[1]  # a block's hash covers its parents
    assert prefix_hashes(ids[:15], 16, "s") == ()


def test_hashes_are_pinned() -> None:
    # blake2b of fixed bytes: the same value on every machine, process and release (hash() is
    # not), so a gateway, engines and a node's KV store of different versions agree
    assert block_hash(None, [1, 2, 3], "tenant:a") == 0xF2AE29FBAC4992B3
    assert block_hash(None, (1, 2, 3), "tenant:a") == block_hash(None, [1, 2, 3], "tenant:a")
