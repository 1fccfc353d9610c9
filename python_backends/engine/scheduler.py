"""The engine's batch scheduler: which sequences compute how many tokens in the next step.

Running sequences go first (their next token or next prompt chunk, most important first), then
waiting ones start in the waiting queue's order (see waiting_queue) while the step's
token budget, the batch size and the free KV blocks allow. When a running sequence needs a block
and none is free, the least important running sequence (lowest priority, then most recently
started) is preempted by recompute: its blocks are freed and it returns to the front of its
queue with its generated tokens, so it later resumes with the same output. A waiting sequence
that outranks running ones and cannot start preempts the same way.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from python_backends.config import EngineLimits
from python_backends.engine.block_manager import BlockManager
from python_backends.engine.guided import grammar_draft
from python_backends.engine.prefix_cache import PrefixCache
from python_backends.engine.sampler import SampleResult
from python_backends.engine.sequence import RELEASED, Sequence, SequenceStatus
from python_backends.engine.speculative import NgramIndex, SpeculationConfig
from python_backends.engine.waiting_queue import FcfsQueue, WaitingQueue
from python_backends.models.attention import window_start
from python_backends.params import FinishReason


@dataclass(frozen=True)
class ScheduledSequence:
    """`num_new_tokens` of the sequence's known tokens, then (a decoding sequence's) `draft`:
    speculative tokens computed after them, kept where the model's choices confirm them.
    `guess`: instead of a draft, the first token of one that would not pay; not computed, only
    checked against the model's choice to keep the sequence's record (SpeculationConfig)."""

    seq: Sequence
    num_new_tokens: int
    draft: tuple[int, ...] = ()
    guess: int | None = None

    @property
    def samples(self) -> bool:
        """Whether this step completes the sequence's known tokens, so its next one is drawn."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def num_tokens(self) -> int:
        """Positions the step computes for the sequence: its new tokens and its draft."""
        return self.num_new_tokens + len(self.draft)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class RequestTooLarge(ValueError):
    pass


class Scheduler:
    def __init__(
        self, limits: EngineLimits, blocks: BlockManager, enable_chunked_prefill: bool = True,
        waiting: WaitingQueue | None = None, prefix: PrefixCache | None = None,
        speculation: SpeculationConfig | None = None, window: int = 0,
    ) -> None:
        """`prefix`: the prefix cache over `blocks` (default: one that is off). `speculation`:
        drafts for greedy decoding sequences (default: off; see engine.speculative). `window`:
        the model's sliding window where every layer has it (0: none): a running sequence
        releases its blocks that no later query can see, so it holds about a window's worth."""
        self.limits = limits
        self.window = window
        self.speculation = speculation or SpeculationConfig()
        self.num_draft_tokens = 0  # since start: speculative tokens computed
        self.num_accepted_tokens = 0  # since start: of those, kept (confirmed by the model)
        self.blocks = blocks
        self.prefix = prefix if prefix is not None else PrefixCache(blocks, enabled=False)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: WaitingQueue = waiting if waiting is not None else FcfsQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt positions computed (prefill work), ever
        self._arrivals = itertools.count()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def check_fits(self, seq: Sequence) -> None:
        longest = min(self.limits.max_seq_len, seq.num_prompt_tokens + seq.params.max_tokens)
        if self.blocks.blocks_for(longest) > self.blocks.num_blocks:
            raise RequestTooLarge(
                f"prompt plus max_tokens ({longest} tokens) needs more KV blocks than the engine "
                f"has ({self.blocks.num_blocks} of {self.blocks.block_size} tokens)"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.arrival_order = next(self._arrivals)
        self.waiting.push(seq)

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish a sequence wherever it is, freeing its blocks. Returns it if it was known."""
        for seq in [*self.running, *self.waiting]:
            if seq.seq_id == seq_id:
                if seq.status is SequenceStatus.RUNNING:
                    self.running.remove(seq)
                else:
                    self.waiting.remove(seq)
                self._finish(seq, FinishReason.CANCELLED)
                return seq
        return None

    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        outranked = self._preempt_for_priority()
        preempted: list[Sequence] = []  # for lack of blocks
        running: list[Sequence] = []
        # Most important first, so the victims of a block shortage are the least important.
        queue = deque(sorted(self.running, key=importance, reverse=True))
        adapts = self.speculation.adapts(len(queue))
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(seq.num_uncomputed_tokens, budget)
            draft, guess = self._draft(seq, budget - n, adapts) if n == 1 else ((), None)
            need = self._blocks_needed(seq, n + len(draft))
            if draft and not self.blocks.can_allocate(need):  # drafts never cost a preemption
                draft, need = (), self._blocks_needed(seq, n)
            while not self.blocks.can_allocate(need) and queue:
                victim = queue.pop()
                self._preempt(victim)
                preempted.append(victim)
            if not self.blocks.can_allocate(need):
                self._preempt(seq)
                preempted.append(seq)
                break
            seq.block_table.extend(self.blocks.allocate(need))
            scheduled.append(ScheduledSequence(seq, n, draft, guess))
            running.append(seq)
            budget -= n + len(draft)
        running.extend(queue)  # budget ran out: they keep their place and run next step
        if not preempted:  # after a block shortage, starting more would only thrash
            while budget > 0 and len(running) < self.limits.max_num_seqs:
                head = self.waiting.peek()
                if head is None:
                    break
                match = self.prefix.match(head)  # empty for a sequence with KV already
                start = head.num_computed_tokens + match.num_blocks * self.blocks.block_size
                n = min(head.num_tokens - start, budget)
                chunked = n < head.num_tokens - start
                if chunked and scheduled and not self.enable_chunked_prefill:
                    break
                need = (self.blocks.blocks_for(start + n) - len(head.block_table)
                        - len(match.local))
                if not self.blocks.can_allocate(need + self.prefix.reused_free(match)):
                    break
                self.waiting.pop()
                self.prefix.take(head, match)  # a failed store read leaves more to compute
                head.block_table.extend(self.blocks.allocate(self._blocks_needed(head, n)))
                head.status = SequenceStatus.RUNNING
                if head.queue_time is None:
                    head.queue_time = time.monotonic() - head.arrival_time
                scheduled.append(ScheduledSequence(head, n))
                running.append(head)
                budget -= n
        self.running = running
        preempted = outranked + preempted
        for victim in reversed(preempted):
            self.waiting.push_front(victim)
        self.num_preemptions += len(preempted)
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _draft(self, seq: Sequence, budget: int,
               adapts: bool) -> tuple[tuple[int, ...], int | None]:
        """A decoding sequence's draft for this step (engine.speculative), and its guess if no
        draft pays (ScheduledSequence). The draft is at most `budget` tokens, and none past the
        sequence's max_tokens or the engine's max_seq_len; as long as a match allows unless the
        step `adapts` (SpeculationConfig.free_rows): then as long as the sequence's record makes
        likely enough to be kept (SpeculationConfig.draft_length), which may be none."""
        spec, p = self.speculation, seq.params
        if (not spec.enabled or not p.greedy or p.needs_logits_processing
                or seq.prefill_only):
            return (), None
        if seq.ngrams is None:
            seq.ngrams = NgramIndex(spec.ngram_lengths)
        room = min(p.max_tokens - seq.num_output_tokens,
                   self.limits.max_seq_len - seq.num_tokens) - 1
        longest = (spec.draft_length(seq.acceptance, len(self.running)) if adapts
                   else spec.num_tokens)
        limit = min(max(longest, 1), budget, room)
        draft = grammar_draft(seq, tuple(seq.ngrams.draft(seq.token_ids(), limit)))
        if longest == 0:
            return (), draft[0] if draft else None
        return draft, None

    def _preempt_for_priority(self) -> list[Sequence]:
        """Make room for a waiting sequence that outranks running ones: while it cannot be
        started (batch full, or too few free blocks for its next chunk), preempt the least
        important running sequence below its priority. The victims' blocks are freed here."""
        victims: list[Sequence] = []
        head = self.waiting.peek()
        if head is None:
            return victims
        while True:
            lower = [s for s in self.running if s.priority < head.priority]
            chunk = min(head.num_uncomputed_tokens, self.limits.max_num_batched_tokens)
            fits = (len(self.running) < self.limits.max_num_seqs
                    and self.blocks.can_allocate(self._blocks_needed(head, chunk)))
            if fits or not lower:
                return victims
            victim = min(lower, key=importance)
            self.running.remove(victim)
            self._preempt(victim)
            victims.append(victim)

    def update(self, out: SchedulerOutput, result: SampleResult) -> list[tuple[Sequence, int]]:
        """Advance computed counts and append sampled tokens (in `out` order of the sampling
        sequences; a sequence with a draft has one per position it computed). Finished sequences
        release their blocks. Returns the sequences that got tokens this step, with how many."""
        sampled: list[tuple[Sequence, int]] = []
        i = 0
        for item in out.scheduled:
            seq = item.seq
            samples = item.samples
            before = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_new_tokens
            self.num_prompt_tokens_computed += max(
                0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - before
            )
            if samples:  # the drafts the model confirms are computed too
                if item.guess is not None:
                    seq.acceptance.record(1, int(result.token_ids[i] == item.guess))
                drawn, reason = self._append(seq, item.draft, result, i)
                i += 1 + len(item.draft)
            self.prefix.cache_computed(seq)
            self._release_behind_window(seq)
            if not samples:
                continue
            sampled.append((seq, drawn))
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            elif seq.prefill_only:
                self.running.remove(seq)
                seq.status = SequenceStatus.FINISHED  # blocks kept: the caller leases them
        return sampled

    def _append(self, seq: Sequence, draft: tuple[int, ...], result: SampleResult,
                row: int) -> tuple[int, FinishReason | None]:
        """Append the tokens the model chose at rows `row`.. (one per computed position): the
        first, then one more for each draft token the previous choice confirmed, up to a token
        that stops the sequence. Returns how many were appended, and why it must stop if so."""
        drawn, reason = 0, None
        for j in range(len(draft) + 1):
            if j:
                if result.token_ids[row + j - 1] != draft[j - 1]:
                    break
                seq.num_computed_tokens += 1  # the confirmed draft token's KV is in the cache
            seq.output_ids.append(result.token_ids[row + j])
            if seq.matcher is not None:
                seq.matcher.consume_token(result.token_ids[row + j])
            if result.logprobs is not None:
                seq.output_logprobs.append(result.logprobs[row + j])
            if result.top is not None and seq.params.top_log_probs:
                seq.output_top.append(result.top[row + j])
            drawn += 1
            reason = stop_reason(seq, self.limits.max_seq_len)
            if reason is not None:
                break
        if draft:
            kept = drawn - 1
            self.num_draft_tokens += len(draft)
            self.num_accepted_tokens += kept
            seq.acceptance.record(len(draft), kept)
        return drawn, reason

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = self.blocks.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def _release_behind_window(self, seq: Sequence) -> None:
        """Release the leading blocks wholly before the window of the sequence's next query
        (every later query's window starts later still). They were cached as they filled, so
        they stay findable for another sequence's prefix until evicted. Not for a prefill
        instance's sequence: its blocks are handed to a decode instance whole."""
        if not self.window or seq.prefill_only:
            return
        first_seen = window_start(seq.num_computed_tokens, self.window)
        behind = min(first_seen // self.blocks.block_size, len(seq.block_table))
        if behind <= seq.num_released_blocks:
            return
        # Last block first: the earliest, the one a shared prefix needs most, is evicted last.
        self.blocks.release(seq.block_table[seq.num_released_blocks:behind][::-1])
        seq.block_table[seq.num_released_blocks:behind] = [RELEASED] * (
            behind - seq.num_released_blocks)
        seq.num_released_blocks = behind

    def _preempt(self, seq: Sequence) -> None:
        # Last block first: the prefix is evicted last, so the sequence's return hits it.
        self.blocks.release(seq.held_blocks()[::-1])
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        seq.status = SequenceStatus.WAITING

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.blocks.release(seq.held_blocks()[::-1])
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def importance(seq: Sequence) -> tuple[int, int]:
    """Orders sequences for preemption: higher priority, then started earlier, ranks higher."""
    return seq.priority, -seq.arrival_order


def stop_reason(seq: Sequence, max_seq_len: int) -> FinishReason | None:
    """Why the sequence must stop after its latest token, if it must."""
    p = seq.params
    n = seq.num_output_tokens
    if n >= p.min_tokens:
        if seq.output_ids[-1] in p.end_ids:
            return FinishReason.STOP
        for stop in p.stop_sequences:
            if len(stop) <= n and tuple(seq.output_ids[-len(stop) :]) == stop:
                return FinishReason.STOP
    if seq.matcher is not None and seq.matcher.is_stopped():  # its language allows no more
        return FinishReason.STOP
    if n >= p.max_tokens or seq.num_tokens >= max_seq_len:
        return FinishReason.LENGTH
    return None
