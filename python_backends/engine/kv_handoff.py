"""The engine's side of a KV handoff between instances: the pool KV transports see, sequences
whose KV another instance computed (pulled in here, then scattered to the ranks), and prefilled
sequences whose KV leaves (gathered from the ranks, then pulled by the other side).

Words, here and in kv_transfer: a handoff is the whole move of a request's KV from a prefill
instance to a decode instance; a pull is the decode side's copy of the owner's blocks (one
transport call); gather and scatter move blocks between the ranks' slices and the whole pool.

The pool transports see always has the whole model's layout (every layer, every KV head), so
engines with different TP/PP layouts can hand KV to each other. A single-rank engine computes in
it directly; a multi-rank one computes in per-rank slices (see engine.ranks).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from python_backends.engine.block_manager import BlockManager
from python_backends.engine.model_runner import ModelRunner
from python_backends.engine.scheduler import Scheduler
from python_backends.engine.sequence import Sequence, SequenceStatus
from python_backends.kv_transfer.layout import KVLayout, allocate_pool
from python_backends.params import FinishReason

log = logging.getLogger(__name__)

# Copies a handed-off sequence's KV into the given local blocks; False: not possible (recompute).
# Raises BlocksInDoubt when a copy may still write into the blocks after it gave up.
KVPull = Callable[[list[int]], bool]


class BlocksInDoubt(RuntimeError):
    """A KV copy into local blocks could neither finish nor be stopped: the blocks may still be
    written, so they are kept out of use for the engine's life (`quarantined`)."""


@dataclass
class PendingHandoff:
    """A sequence prefilled elsewhere, waiting for blocks to pull its KV into."""

    seq: Sequence
    num_kv_tokens: int
    pull: KVPull


class KVHandoff:
    def __init__(self, layout: KVLayout, runner: ModelRunner, blocks: BlockManager,
                 scheduler: Scheduler, pool: torch.Tensor | None = None) -> None:
        """`layout`: the whole-model layout transports move. `pool`: the tensor they see (shared
        memory for host_shm); a single-rank engine's runner computes in it, a multi-rank engine
        allocates it on first use."""
        self.layout = layout
        self._runner = runner
        self._blocks = blocks
        self._scheduler = scheduler
        self._pool = pool
        self.pending: deque[PendingHandoff] = deque()
        self.quarantined: list[int] = []  # blocks a stuck copy may still write (BlocksInDoubt)

    @property
    def pool(self) -> torch.Tensor:
        """The whole-model pool KV transports read from and write into."""
        if self._runner.group is None:
            return self._runner.kv_pool
        if self._pool is None:
            self._pool = allocate_pool(self.layout, device=self._runner.kv_pool.device)
        return self._pool

    def add(self, seq: Sequence, num_kv_tokens: int, pull: KVPull) -> None:
        """Queue `seq` (its first token already drawn elsewhere): before a later step, blocks are
        allocated for its first `num_kv_tokens` tokens and `pull` fills them; if it cannot, the
        prompt is recomputed here."""
        if num_kv_tokens > seq.num_prompt_tokens:
            raise ValueError(f"{num_kv_tokens} KV tokens for a {seq.num_prompt_tokens}-token "
                             "prompt")
        self._scheduler.check_fits(seq)
        self.pending.append(PendingHandoff(seq, num_kv_tokens, pull))

    def pull(self) -> None:
        """Pull queued imports while blocks are free (in arrival order), then hand the sequences
        to the scheduler like any other: computed up to the imported tokens, or not at all."""
        while self.pending:
            item = self.pending[0]
            need = self._blocks.blocks_for(item.num_kv_tokens)
            if not self._blocks.can_allocate(need) and self._scheduler.has_unfinished:
                break  # blocks free up as running sequences finish
            self.pending.popleft()
            blocks = self._blocks.allocate(need) if self._blocks.can_allocate(need) else None
            if blocks is not None and self._pull(item, blocks):
                if self._runner.group is not None:
                    self._runner.group.scatter_kv(self._runner.kv_pool, self.pool, blocks)
                item.seq.block_table = blocks
                item.seq.num_computed_tokens = item.num_kv_tokens
                self._scheduler.prefix.cache_computed(item.seq)
            self._scheduler.add(item.seq)

    def _pull(self, item: PendingHandoff, blocks: list[int]) -> bool:
        """Fill `blocks` through its pull; on failure they go back to the free list,
        or, when a copy may still write into them, out of use for good."""
        try:
            if item.pull(blocks):
                return True
            self._blocks.release(blocks)
        except BlocksInDoubt as e:
            self.quarantined.extend(blocks)  # allocated for good: nothing else gets them
            log.error("KV blocks %s quarantined (%d in all): %s", blocks, len(self.quarantined),
                      e)
        return False

    def export(self, blocks: list[int]) -> None:
        """Make `blocks` (of prefilled sequences about to be handed over) readable in `pool`."""
        if blocks and self._runner.group is not None:
            self._runner.group.gather_kv(self._runner.kv_pool, self.pool, blocks)

    def abort(self, seq_id: str) -> Sequence | None:
        """Drop a pending handoff; returns its sequence, finished as cancelled."""
        for item in self.pending:
            if item.seq.seq_id == seq_id:
                self.pending.remove(item)
                item.seq.status = SequenceStatus.FINISHED
                item.seq.finish_reason = FinishReason.CANCELLED
                return item.seq
        return None
