"""Prefix caching: a sequence starts from the KV of its longest cached prefix of full blocks.

Blocks are matched by chained hash (prefix_hash.block_hash, salted per tenant or request) and
confirmed by their token ids; they are cached only once their KV exists (`cache_computed`),
never while a step may still write them. The last token of a sequence is always computed, so
its logits exist: a fully cached prompt recomputes its last block.

Behind the engine's own pool, an optional second tier (`KVTier`, the node's host-memory KV
store) is asked for the blocks the pool misses, and receives the blocks the pool evicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from python_backends.engine.block_manager import BlockManager
from python_backends.engine.sequence import Sequence
from python_backends.prefix_hash import BlockHash


class KVTier(Protocol):
    """A KV store behind the engine's pool, addressed by block hash (kv_store.tier)."""

    bytes_read: int
    bytes_written: int

    def contains(self, key: BlockHash) -> bool: ...

    def read(self, key: BlockHash, tokens: tuple[int, ...], block: int) -> bool:
        """Copy the entry into pool block `block`; False if it is gone or was being written."""
        ...

    def write(self, key: BlockHash, tokens: tuple[int, ...], block: int) -> None:
        """Copy pool block `block` in (best effort: a full or absent store skips it)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PrefixMatch:
    """The leading full blocks of a sequence found cached: `local` in the pool (in order),
    then `remote` ones the tier holds (their keys and token ids)."""

    local: tuple[int, ...] = ()
    remote: tuple[tuple[BlockHash, tuple[int, ...]], ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.local) + len(self.remote)


class PrefixCache:
    def __init__(self, blocks: BlockManager, enabled: bool = True,
                 tier: KVTier | None = None) -> None:
        self.blocks = blocks
        self.enabled = enabled
        self.tier = tier
        self.num_queries = 0  # tokens looked up (ever)
        self.num_hits = 0  # of those, found in the pool or the tier
        self.num_tier_hits = 0  # blocks read from the tier
        self.num_tier_misses = 0  # blocks the pool missed and the tier could not give

    def match(self, seq: Sequence) -> PrefixMatch:
        """The cached prefix of a sequence that holds no blocks yet. Changes nothing."""
        if not self.enabled or seq.holds_kv:
            return PrefixMatch()
        bs = self.blocks.block_size
        hashes = seq.block_hashes(bs, (seq.num_tokens - 1) // bs)
        local: list[int] = []
        for i, key in enumerate(hashes):
            block = self.blocks.lookup(key, seq.tokens(i * bs, (i + 1) * bs))
            if block is None:
                break
            local.append(block)
        remote = []
        if self.tier is not None:
            for i in range(len(local), len(hashes)):
                if not self.tier.contains(hashes[i]):
                    break
                remote.append((hashes[i], tuple(seq.tokens(i * bs, (i + 1) * bs))))
        return PrefixMatch(tuple(local), tuple(remote))

    def reused_free(self, match: PrefixMatch) -> int:
        """Cached blocks of the match that are free now: `take` takes them out of the free
        pool (beyond the new blocks the sequence needs)."""
        return sum(self.blocks.is_free(b) for b in match.local)

    def take(self, seq: Sequence, match: PrefixMatch) -> None:
        """Start `seq` from its match: share the pool's blocks, read the tier's into new
        ones (stopping at the first that fails), and count the lookup. A sequence that holds
        KV already (imported from a prefill instance) is left as it is."""
        if seq.holds_kv:
            return
        for b in match.local:
            self.blocks.share(b)
        seq.block_table = list(match.local)
        if match.remote:
            assert self.tier is not None
            new = self.blocks.allocate(len(match.remote))
            read = 0
            for (key, tokens), block in zip(match.remote, new, strict=True):
                if not self.tier.read(key, tokens, block):
                    break
                self.blocks.cache(block, key, tokens)
                read += 1
            self.num_tier_hits += read
            self.num_tier_misses += len(match.remote) - read
            seq.block_table.extend(new)  # unread ones are computed like any block
            cached = len(match.local) + read
        else:
            cached = len(match.local)
        seq.num_computed_tokens = cached * self.blocks.block_size
        seq.num_cached_blocks = cached
        if self.enabled:
            self.num_queries += seq.num_tokens
            self.num_hits += seq.num_computed_tokens

    def cache_computed(self, seq: Sequence) -> None:
        """Cache the sequence's full blocks whose KV is now computed (after a step or a KV
        import); the tier gets a copy of each newly cached block."""
        if not self.enabled:
            return
        bs = self.blocks.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if full <= seq.num_cached_blocks:  # most steps complete no block
            return
        hashes = seq.block_hashes(bs, full)
        for i in range(seq.num_cached_blocks, full):
            tokens = tuple(seq.tokens(i * bs, (i + 1) * bs))
            block = seq.block_table[i]
            self.blocks.cache(block, hashes[i], tokens)
            if self.tier is not None:
                self.tier.write(hashes[i], tokens, block)
        seq.num_cached_blocks = full
