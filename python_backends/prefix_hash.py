"""What "this prefix is cached" means, everywhere: a full block of token ids is known by a hash
chained from its parent's, the first block's covering the cache salt. Engines key their prefix
caches and the node's KV store by it; the gateway routes on it, hashing prompts with each
server's own block size and salt rules, so a prefix it believes cached is the one an engine
would find.

blake2b, not hash(): equal across processes, machines and restarts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = int


def block_hash(parent: BlockHash | None, tokens: Sequence[int], salt: str = "") -> BlockHash:
    """The hash of a full block of `tokens` after the block hashed `parent` (None: the first
    block, whose hash also covers `salt`, so differently salted prefixes never match)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"root:" + salt.encode() if parent is None else parent.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_hashes(token_ids: Sequence[int], block_size: int, salt: str) -> tuple[BlockHash, ...]:
    """The chained hashes of the full blocks of `token_ids` (a partial last block has none)."""
    out: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size], salt)
        out.append(parent)
    return tuple(out)
