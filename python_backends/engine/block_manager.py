"""Fixed-size KV blocks with reference counts, and the prefix cache over them.

A block is shared when its count is above one; it becomes free only when the last holder
releases it. A full block whose KV exists can also be cached under its chained hash (`cache`):
when freed it stays findable (`lookup`, then `share` takes it back) until `allocate` needs it
for new content, which evicts it (the `on_evict` hook sees its content first: the KV store's
write-back). Free blocks are reused least recently freed first, so a freed prefix stays
cached as long as the pool allows. Why the free list is an OrderedDict and not a deque: a
prefix hit takes a cached block out of the middle of the free order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from python_backends.prefix_hash import BlockHash

Evict = Callable[[BlockHash, tuple[int, ...], int], None]  # hash, token ids, block id


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, on_evict: Evict | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.on_evict = on_evict
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._block_of: dict[BlockHash, int] = {}  # cached blocks, by hash
        self._hash_of: dict[int, tuple[BlockHash, tuple[int, ...]]] = {}  # block -> (hash, ids)
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are reused on demand)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, least recently freed first, each with a reference count of
        one; a cached one is evicted (after `on_evict`)."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, block: int) -> None:
        """One more holder of `block`: an allocated one, or a cached free one (taken back)."""
        if self._ref_counts[block] == 0:
            if block not in self._hash_of:
                raise ValueError(f"block {block} is free and cannot be shared")
            del self._free[block]
        self._ref_counts[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, in order; blocks nobody holds become free (the
        last released is the last evicted)."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} released more often than allocated")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def cache(self, block: int, key: BlockHash, tokens: Sequence[int]) -> None:
        """Make `block` (held, full, its KV computed) findable under `key`. A key already
        cached in another block keeps that one; this block then frees as uncached."""
        if key in self._block_of or block in self._hash_of:
            return
        self._block_of[key] = block
        self._hash_of[block] = (key, tuple(tokens))

    def lookup(self, key: BlockHash, tokens: Sequence[int]) -> int | None:
        """The block cached under `key`, if its token ids are `tokens` (confirmed, so a hash
        collision is a miss)."""
        block = self._block_of.get(key)
        if block is None or self._hash_of[block][1] != tuple(tokens):
            return None
        return block

    def is_free(self, block: int) -> bool:
        return self._ref_counts[block] == 0

    def _evict(self, block: int) -> None:
        cached = self._hash_of.pop(block, None)
        if cached is None:
            return
        key, tokens = cached
        del self._block_of[key]
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(key, tokens, block)
