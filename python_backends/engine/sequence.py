"""Request state: a few counters and lists; everything else is derived.

There is no prefill or decode phase: a sequence has `num_tokens` (prompt plus generated) and
`num_computed_tokens` (whose KV is in the cache). The gap is the work left before the next sample:
a whole prompt, a chunk of one, a recompute after preemption, or one token while decoding.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from python_backends.engine.speculative import Acceptance, NgramIndex
from python_backends.params import FinishReason, SamplingParams
from python_backends.prefix_hash import BlockHash, block_hash

RELEASED = -1  # a block_table entry whose block was released behind a sliding window
# A token's likeliest alternatives: (token id, log-probability) pairs, likeliest first.
Top = tuple[tuple[int, float], ...]


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # higher is started first and preempted last
    tenant: str = "default"
    arrival_order: int = 0  # arrival order at the scheduler, set by it
    arrival_time: float = field(default_factory=time.monotonic)
    queue_time: float | None = None  # arrival to first scheduled step, set by the scheduler
    first_token_time: float | None = None  # first token drawn here (or handed-off arrival)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # with params.top_log_probs: each output token's likeliest alternatives
    output_top: list[Top] = field(default_factory=list)
    num_computed_tokens: int = 0
    # The KV block of each block of positions. Under a sliding window the leading ones no query
    # can see any more are released (Scheduler._release_behind_window) and read RELEASED.
    block_table: list[int] = field(default_factory=list)
    num_released_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    # A prefill instance's sequence: after its first token it leaves the batch keeping its KV
    # blocks (finish_reason None), which the instance then leases to a decode instance.
    prefill_only: bool = False
    # Prefix caching: only sequences with the same salt share blocks (a tenant, or the request's
    # cache_salt). `num_cached_blocks`: leading blocks of block_table already in the cache.
    cache_salt: str = ""
    num_cached_blocks: int = 0
    # Speculative decoding (engine.speculative): the sequence's n-gram index, made when it first
    # drafts, and how often its draft tokens (and guesses) were kept lately.
    ngrams: NgramIndex | None = field(default=None, repr=False)
    acceptance: Acceptance = field(default_factory=Acceptance, repr=False)
    # Structured output: the llguidance matcher of a guided sequence (engine.guided), fed every
    # token it appends.
    matcher: Any = field(default=None, repr=False)
    _block_hashes: list[BlockHash] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def continue_from(self, token_ids: list[int], logprobs: list[float]) -> None:
        """This sequence's first output tokens were drawn elsewhere: by a prefill instance (the
        first token, with its KV imported) or by an engine that died mid-request (a migration:
        they are computed with the prompt). Its decode time counts from now."""
        self.output_ids.extend(token_ids)
        self.first_token_time = time.monotonic()
        if self.params.return_log_probs:
            self.output_logprobs.extend(logprobs)
        if self.params.top_log_probs:  # not known here: drawn elsewhere
            self.output_top.extend(() for _ in token_ids)

    def held_blocks(self) -> list[int]:
        """The blocks it holds: its block table less those released behind a window."""
        return self.block_table[self.num_released_blocks:]

    @property
    def holds_kv(self) -> bool:
        """It has blocks or computed tokens already: it ran before, or its KV was imported."""
        return bool(self.block_table) or self.num_computed_tokens > 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) (prompt, then output)."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    def block_hashes(self, block_size: int, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the first `num_blocks` full blocks (computed once each)."""
        hashes = self._block_hashes
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(block_hash(parent, self.tokens(i * block_size, (i + 1) * block_size),
                                     self.cache_salt))
        return hashes[:num_blocks]

    def token_at(self, index: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[index] if index < p else self.output_ids[index - p]
