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
from typing import ClassVar


@dataclass(frozen=True)
class SpeculationConfig:
    """`num_tokens`: the longest draft (0: off). `ngram_max`..`ngram_min`: the n-gram lengths
    looked up, longest first. `adaptive`: in steps of more than `free_rows` rows each sequence
    drafts only the tokens likely enough to be kept to pay for their rows (`draft_length`),
    which may be none: such a sequence's match is only a guess, checked against the token the
    step chooses without a row computed for it, so its record follows its text at no cost and
    it drafts again once its guesses would pay; else, and in steps that small, every draft is as
    long as a match allows.

    `free_rows`: a step of that many rows or fewer (running sequences x (num_tokens + 1)) is
    bound by reading the weights, not by arithmetic (the native kernel's tiles are 12 rows: one
    pass over the weights serves them all), so drafts there cost next to nothing however often
    they fail, and holding them back only loses the ones that would have been kept. Measured on the
    chat workload at concurrency 1 (engine alone, 2-core AMD EPYC): fixed drafting 1.27-1.53x
    drafting off against adaptive's 1.16-1.35x. Weights read as exact GGUF blocks
    (models.weight_blocks) make rows there cost about a fifth of a one-row step each, no longer
    next to nothing; adapting at every size (`free_rows` 0) still measured the same at one
    sequence (chat 91.8 against 92.8 tok/s, synthetic 130.5 against 128.2), so 16 stays.

    `overhead_rows`: past `free_rows` a step's time grows with its rows, as about
    `overhead_rows` + rows row-times (what a step costs besides its rows: reading the weights,
    the engine's own work). A step of n sequences yields about n tokens in n + overhead_rows
    row-times, so one more row, a draft token kept with chance p, pays only if p is at least
    n / (n + overhead_rows) (`min_acceptance`): 0.62 at 8 sequences, 0.86 at 32. Measured (engine
    alone, 2-core AMD EPYC): at 32 sequences drafts kept 94-99% of the time gained 5-10% over
    drafting off, which makes the overhead about 5 rows, and drafting every match on chat text
    (35% kept) cost 13-16%."""

    num_tokens: int = 0
    ngram_max: int = 3
    ngram_min: int = 2
    adaptive: bool = True
    free_rows: int = 16
    overhead_rows: float = 5.0

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_tokens}")
        if self.free_rows < 0:
            raise ValueError(f"free_rows must be >= 0, got {self.free_rows}")
        if self.overhead_rows <= 0:
            raise ValueError(f"overhead_rows must be > 0, got {self.overhead_rows}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0

    def adapts(self, running: int) -> bool:
        """Whether drafts adapt in a step of `running` sequences (see `free_rows`)."""
        return self.adaptive and running * (self.num_tokens + 1) > self.free_rows

    def min_acceptance(self, running: int) -> float:
        """The least chance of being kept for which a draft token pays in a step of `running`
        sequences that adapts (see `overhead_rows`)."""
        return running / (running + self.overhead_rows)

    def draft_length(self, acceptance: Acceptance, running: int) -> int:
        """The longest draft whose last token a sequence with `acceptance` keeps with at least
        `min_acceptance(running)` chance (a token is kept only if the ones before it are); 0
        if not even the first would pay: the sequence only guesses (see `adaptive`)."""
        q, least, n = acceptance.rate, self.min_acceptance(running), 0
        while n < self.num_tokens and q ** (n + 1) >= least:
            n += 1
        return n

    @property
    def ngram_lengths(self) -> tuple[int, ...]:
        """The n-gram lengths looked up, longest first."""
        return tuple(range(self.ngram_max, self.ngram_min - 1, -1))


@dataclass
class Acceptance:
    """A sequence's recent record of draft tokens: `kept` of `tried`, each draft's counts
    weighted `DECAY` times the one after it, from a prior of 1.5 kept in 2. A token is tried
    only if the ones before it were kept, so `rate` estimates the chance that a draft token is
    kept given that the one before it was. A guess (a draft's first token checked without
    being computed) counts as a one-token draft."""

    DECAY: ClassVar[float] = 0.75
    kept: float = 1.5
    tried: float = 2.0

    @property
    def rate(self) -> float:
        return self.kept / self.tried

    def record(self, drafted: int, kept: int) -> None:
        """A draft of `drafted` tokens of which the first `kept` were kept."""
        self.kept = self.DECAY * self.kept + kept
        self.tried = self.DECAY * self.tried + min(kept + 1, drafted)


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
