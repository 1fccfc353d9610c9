"""Fixed-size KV blocks with reference counts.

A block is shared when its count is above one (prefix caching hands the same block to several
sequences); it returns to the free list only when the last holder releases it.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
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
        """Take `n` free blocks, each with a reference count of one."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def share(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            raise ValueError(f"block {block} is free and cannot be shared")
        self._ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds become free."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} released more often than allocated")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
