"""Prompt-lookup speculative decoding: drafts copied from a sequence's own earlier tokens.

A greedy sequence whose last few tokens (an n-gram) occurred before in its prompt or output
proposes the tokens that followed that occurrence as a draft. The step computes the sequence's
next token and the draft's tokens together, as decode rows of one batch (each row attends to the
context up to its own position), and the scheduler keeps the drafts that the model's own greedy
choices confirm, plus the choice after the last confirmed one (Scheduler.update). The output is
the one plain greedy decoding gives; what changes is how many tokens a step yields, at the cost
of a few more rows through the projections, which a memory-bound step reads the weights for
anyway. Nothing is proposed without a match, so text that does not repeat itself pays nothing.

Only sequences that are greedy with no logits processing speculate: penalties, bans and
sampling depend on the tokens before each position, which the draft would have to replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_DRAFT_PAUSE = 32  # steps: the longest a sequence whose drafts keep failing stops drafting


@dataclass(frozen=True)
class SpeculationConfig:
    """`num_tokens`: the longest draft (0: off). `ngram_max`..`ngram_min`: the n-gram lengths
    looked up, longest first. `adaptive`: each sequence's drafts follow its own acceptance (a
    draft is one token longer than its last one kept, and a sequence whose drafts keep failing
    pauses drafting, `draft_pause`) in steps of more than `free_rows` rows; else, and in steps
    that small, every draft is as long as a match allows.

    `free_rows`: a step of that many rows or fewer (running sequences x (num_tokens + 1)) is
    bound by reading the weights, not by arithmetic (the native kernel's tiles are 12 rows: one
    pass over the weights serves them all), so drafts there cost next to nothing however often
    they fail, and pausing them only loses the ones that would have been kept. Measured on the
    chat workload at concurrency 1 (engine alone, 2-core AMD EPYC): fixed drafting 1.27-1.53x
    drafting off against adaptive's 1.16-1.35x; from concurrency 8 on adaptive is ahead."""

    num_tokens: int = 0
    ngram_max: int = 3
    ngram_min: int = 2
    adaptive: bool = True
    free_rows: int = 16

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_tokens}")
        if self.free_rows < 0:
            raise ValueError(f"free_rows must be >= 0, got {self.free_rows}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0

    def adapts(self, running: int) -> bool:
        """Whether drafts adapt in a step of `running` sequences (see `free_rows`)."""
        return self.adaptive and running * (self.num_tokens + 1) > self.free_rows

    def draft_pause(self, misses: int) -> int:
        """The steps a sequence drafts nothing after `misses` drafts in a row of which nothing
        was kept: 1, 3, 7, ... up to MAX_DRAFT_PAUSE, so text that does not repeat itself
        costs at most a draft now and then, and text that starts repeating drafts again soon."""
        return min(2 ** misses - 1, MAX_DRAFT_PAUSE) if self.adaptive and misses else 0

    @property
    def ngram_lengths(self) -> tuple[int, ...]:
        """The n-gram lengths looked up, longest first."""
        return tuple(range(self.ngram_max, self.ngram_min - 1, -1))


@dataclass
class NgramIndex:
    """A sequence's n-grams (lengths `lengths`) to the position after their latest occurrence,
    extended as the sequence grows. Each token is indexed once: O(1) per token and lookup."""

    lengths: tuple[int, ...]
    _next: dict[tuple[int, ...], int] = field(default_factory=dict)
    _indexed: int = 0  # n-grams ending before this position are in `_next`

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        n-gram ending `tokens`; [] if none occurred. A continuation that runs into the n-gram
        itself (a repeating cycle) goes on along the cycle."""
        if limit <= 0:
            return []
        end = len(tokens) - 1  # n-grams must end before the last token to have a follower
        for stop in range(self._indexed, end):
            for n in self.lengths:
                if stop + 1 >= n:
                    self._next[tuple(tokens[stop + 1 - n : stop + 1])] = stop + 1
        self._indexed = max(self._indexed, end)
        for n in self.lengths:
            if len(tokens) < n:
                continue
            start = self._next.get(tuple(tokens[-n:]))
            if start is not None:
                period = len(tokens) - start  # the draft repeats the span [start, end]
                return [tokens[start + i % period] for i in range(limit)]
        return []
