"""Prompt-lookup speculative decoding: the drafts, and the engine's output with them (Hugging
Face's greedy output, token for token, whatever the drafts were)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from python_backends.config import EngineLimits
from python_backends.engine.llm_engine import LLMEngine, TokenEvent
from python_backends.engine.speculative import Acceptance, NgramIndex, SpeculationConfig
from python_backends.params import FinishReason, SamplingParams
from tests.conftest import TinyModel, prompts
from tests.engine.test_llm_engine import run_all

SPEC = SpeculationConfig(4)


def looping_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short random phrase (so there is something to look up), then end
    in a few random tokens (so the model's continuation may leave the phrase)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        phrase = torch.randint(1, 256, (int(torch.randint(2, 6, (1,), generator=g)),),
                               generator=g).tolist()
        tail = torch.randint(1, 256, (int(torch.randint(0, 3, (1,), generator=g)),),
                             generator=g).tolist()
        out.append(phrase * 4 + tail)
    return out


def test_draft_follows_the_latest_occurrence_of_the_longest_ngram() -> None:
    index = NgramIndex((3, 2, 1))
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # "6 7" last occurred at 5-6 (followed by 9 2 6 7), before that at 1-2 (followed by 8)
    assert index.draft(tokens, 3) == [9, 2, 6]
    assert index.draft([*tokens, 9, 2], 2) == [6, 7]  # "7 9 2" (3-gram) at 6-8, the longest
    assert index.draft(tokens, 0) == []
    assert NgramIndex((3, 2)).draft([1, 2, 3, 4], 4) == []  # no earlier occurrence
    assert NgramIndex((2,)).draft([4], 4) == []


def test_a_cycle_is_drafted_past_its_end() -> None:
    assert NgramIndex((2, 1)).draft([3, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert NgramIndex((1,)).draft([7, 7], 3) == [7, 7, 7]


def test_the_index_grows_with_the_sequence_as_a_fresh_one_would_see_it() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (120,), generator=g).tolist()
    grown = NgramIndex((3, 2))
    for end in range(1, len(tokens) + 1):
        assert grown.draft(tokens[:end], 4) == NgramIndex((3, 2)).draft(tokens[:end], 4)


@pytest.mark.parametrize("kwargs", [{"num_tokens": -1}, {"ngram_min": 0},
                                    {"ngram_min": 3, "ngram_max": 2}])
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SpeculationConfig(**kwargs)


def _drafts(engine: LLMEngine) -> tuple[int, int]:
    s = engine.stats()
    return s.draft_tokens, s.draft_tokens_accepted


class Oracle:
    """Drafts from the known greedy continuation `want` of `prompt`, the `wrong`-th token of
    every other draft replaced: the model must keep what is right and refuse the rest."""

    def __init__(self, prompt: list[int], want: list[int], wrong: int) -> None:
        self.prompt, self.want, self.wrong, self.calls = prompt, want, wrong, 0

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        done = len(tokens) - len(self.prompt)
        assert tokens == self.prompt + self.want[:done]  # exactly the tokens kept so far
        out = self.want[done : done + limit]
        self.calls += 1
        if self.calls % 2 and self.wrong < len(out):
            out[self.wrong] = (out[self.wrong] + 1) % 250  # in every test vocabulary
        return out


def test_confirmed_drafts_are_kept_refused_ones_dropped_and_the_output_is_hf(
        tiny_llama: TinyModel) -> None:
    """The drafts' own KV (kept ones) carries the later tokens: output equals HF's."""
    batch = prompts(6, seed=1)
    want = [tiny_llama.greedy(p, 24) for p in batch]
    engine = tiny_llama.engine(speculation=SPEC)
    seqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=24))
            for i, p in enumerate(batch)]
    for i, seq in enumerate(seqs):
        seq.ngrams = Oracle(batch[i], want[i], wrong=i % 4)  # type: ignore[assignment]
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    assert [s.output_ids for s in seqs] == want
    drafted, kept = _drafts(engine)
    assert 0 < kept < drafted and steps < 24 and engine.blocks.num_used == 0


def test_greedy_output_equals_hf_with_lookup_drafts(tiny_llama: TinyModel) -> None:
    batch = looping_prompts(6, seed=1) + prompts(2, seed=2)
    engine = tiny_llama.engine(speculation=SPEC)
    assert run_all(engine, batch, 24) == [tiny_llama.greedy(p, 24) for p in batch]
    assert _drafts(engine)[0] > 0


def with_oracle(engine: LLMEngine, seq_id: str, prompt: list[int], params: SamplingParams,
                want: list[int], wrong: int = 1) -> None:
    seq = engine.add_request(seq_id, prompt, params)
    seq.ngrams = Oracle(prompt, want, wrong)  # type: ignore[assignment]


def events_until_done(engine: LLMEngine) -> tuple[list[TokenEvent], int]:
    events: list[TokenEvent] = []
    steps = 0
    while engine.has_unfinished:
        events += engine.step()
        steps += 1
    return events, steps


def test_each_token_is_one_event_and_only_the_last_finishes(tiny_llama: TinyModel) -> None:
    p = prompts(1, seed=3)[0]
    params = SamplingParams(max_tokens=20, return_log_probs=True)
    engine = tiny_llama.engine(speculation=SPEC)
    with_oracle(engine, "s", p, params, tiny_llama.greedy(p, 20))
    events, steps = events_until_done(engine)
    assert [e.num_output_tokens for e in events] == list(range(1, 21))
    assert [e.finish_reason for e in events] == [None] * 19 + [FinishReason.LENGTH]
    assert [e.decode_time is not None for e in events] == [False] * 19 + [True]
    assert steps < 20 and engine.blocks.num_used == 0  # some step drew several tokens
    plain = tiny_llama.engine()
    plain.add_request("s", p, params)
    want, _ = events_until_done(plain)
    assert [e.token_id for e in events] == [e.token_id for e in want]
    got_lp = torch.tensor([e.logprob for e in events])
    want_lp = torch.tensor([e.logprob for e in want])
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-4, atol=1e-4)


def test_a_stop_inside_a_draft_ends_the_sequence_there(tiny_llama: TinyModel) -> None:
    p = prompts(1, seed=3)[0]
    ref = tiny_llama.greedy(p, 20)
    engine = tiny_llama.engine(speculation=SPEC)
    with_oracle(engine, "end", p, SamplingParams(max_tokens=20, end_ids=(ref[9],)), ref)
    with_oracle(engine, "stop", p,
                SamplingParams(max_tokens=20, stop_sequences=(tuple(ref[10:12]),)), ref)
    with_oracle(engine, "length", p, SamplingParams(max_tokens=11), ref)
    got: dict[str, list[int]] = {"end": [], "stop": [], "length": []}
    reasons = {}
    for ev in events_until_done(engine)[0]:
        got[ev.seq_id].append(ev.token_id)
        if ev.finish_reason is not None:
            reasons[ev.seq_id] = ev.finish_reason
    assert got["end"] == ref[: ref.index(ref[9]) + 1]
    stop_at = next(i for i in range(1, 20) if ref[i - 1: i + 1] == ref[10:12])
    assert got["stop"] == ref[: stop_at + 1]
    assert got["length"] == ref[:11]
    assert reasons == {"end": FinishReason.STOP, "stop": FinishReason.STOP,
                       "length": FinishReason.LENGTH}
    assert _drafts(engine)[1] > 0 and engine.blocks.num_used == 0


def test_drafts_stop_at_max_seq_len(tiny_llama: TinyModel) -> None:
    p = prompts(1, seed=4)[0]
    engine = tiny_llama.engine(speculation=SPEC)
    engine.scheduler.limits = EngineLimits(max_seq_len=len(p) + 9, max_num_seqs=16,
                                           max_num_batched_tokens=256, block_size=4)
    want = tiny_llama.greedy(p, 30)
    with_oracle(engine, "s", p, SamplingParams(max_tokens=50), want, wrong=9)  # all right
    events, _ = events_until_done(engine)
    assert [e.token_id for e in events] == want[:9]
    assert events[-1].finish_reason is FinishReason.LENGTH and _drafts(engine)[1] > 0


def test_sampled_and_penalized_sequences_do_not_draft_and_keep_their_output(
        tiny_llama: TinyModel) -> None:
    p = prompts(1, seed=5)[0]
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=7),
              SamplingParams(max_tokens=16, repetition_penalty=1.3)]

    def outputs(speculation: SpeculationConfig | None) -> list[list[int]]:
        engine = tiny_llama.engine(speculation=speculation)
        seqs = [engine.add_request(str(i), p, sp) for i, sp in enumerate(params)]
        with_oracle(engine, "greedy", p, SamplingParams(max_tokens=16),  # drafts beside them
                    tiny_llama.greedy(p, 16))
        events_until_done(engine)
        assert engine.stats().draft_tokens > 0 or speculation is None
        assert all(s.ngrams is None for s in seqs)  # never looked anything up
        return [s.output_ids for s in seqs]

    assert outputs(SPEC) == outputs(None)


def test_drafts_never_preempt_and_preemption_keeps_the_output(tiny_llama: TinyModel) -> None:
    batch = looping_prompts(6, seed=6)
    engine = tiny_llama.engine(num_kv_blocks=30, speculation=SPEC)
    assert run_all(engine, batch, 24) == [tiny_llama.greedy(p, 24) for p in batch]
    assert engine.scheduler.num_preemptions > 0 and _drafts(engine)[0] > 0


class Wrong:
    """Drafts `limit` tokens that are never the model's choice (until `good_after` calls, then
    the right ones): text on which lookup drafting does not pay."""

    def __init__(self, prompt: list[int], want: list[int], good_after: int = 10**9) -> None:
        self.prompt, self.want, self.good_after, self.calls = prompt, want, good_after, 0

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        self.calls += 1
        done = len(tokens) - len(self.prompt)
        right = self.want[done:done + limit]
        return right if self.calls > self.good_after else [(t + 1) % 250 for t in right]


def _never_kept(tiny_llama: TinyModel, spec: SpeculationConfig, p: list[int],
                want: list[int]) -> tuple[LLMEngine, Wrong]:
    """`p` run to its end (40 tokens) on an engine drafting by `spec` from an oracle whose
    drafts are all wrong; the output is HF's (`want`) whatever was drafted."""
    engine = tiny_llama.engine(speculation=spec)
    seq = engine.add_request("s", p, SamplingParams(max_tokens=40))
    oracle = Wrong(p, want)
    seq.ngrams = oracle  # type: ignore[assignment]
    while engine.has_unfinished:
        engine.step()
    assert seq.output_ids == want
    return engine, oracle


# A lone sequence's steps adapt as a large batch's do (no free rows), with a draft token paying
# only if kept at least 80% of the time (1 / (1 + 0.25)), as at 20 sequences by default.
LIKE_A_LARGE_BATCH = functools.partial(SpeculationConfig, 4, free_rows=0, overhead_rows=0.25)


@pytest.mark.parametrize("adaptive", [True, False])
def test_drafts_that_would_not_pay_are_only_guessed_until_they_would(
        tiny_llama: TinyModel, adaptive: bool) -> None:
    """Adaptive: a sequence whose drafts would never be kept computes none, from the first (the
    prior is below the bar): each match is a guess, checked against the model's choice for no
    row; fixed drafts at every step. Either way the output is HF's. Guesses that start being
    right lift the record over the bar, and the sequence drafts."""
    p = prompts(1, seed=5)[0]
    want = tiny_llama.greedy(p, 40)
    engine, oracle = _never_kept(tiny_llama, LIKE_A_LARGE_BATCH(adaptive=adaptive), p, want)
    assert oracle.calls == 39  # a lookup at every decode step, drafted or only guessed
    full_length = sum(min(4, 39 - done) for done in range(1, 40))
    assert _drafts(engine) == ((0, 0) if adaptive else (full_length, 0))
    assert engine.scheduler.running == [] and engine.blocks.num_used == 0
    # the oracle right from its third lookup on: two guesses right clear 80%, then drafts
    # (without drafts the 40 tokens take 40 steps)
    engine = tiny_llama.engine(speculation=LIKE_A_LARGE_BATCH())
    seq = engine.add_request("t", p, SamplingParams(max_tokens=40))
    seq.ngrams = Wrong(p, want, good_after=2)  # type: ignore[assignment]
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    assert seq.output_ids == want and steps <= 16
    drafted, kept = _drafts(engine)
    assert kept == drafted > 0


def test_steps_of_few_rows_draft_at_every_step_however_drafts_fare(tiny_llama: TinyModel) -> None:
    """Below free_rows a step is bound by reading the weights: a lone sequence drafts at every
    step, full length, though nothing is ever kept; output HF's. Past it, only guesses."""
    p = prompts(1, seed=5)[0]
    want = tiny_llama.greedy(p, 40)
    assert SpeculationConfig(4).adapts(3) is False and SpeculationConfig(4).adapts(4) is True
    engine, oracle = _never_kept(tiny_llama, SpeculationConfig(4), p, want)
    full_length = sum(min(4, 39 - done) for done in range(1, 40))  # all the room left allows
    assert oracle.calls == 39 and _drafts(engine) == (full_length, 0)


def test_a_draft_token_pays_if_kept_as_often_as_the_batch_needs() -> None:
    """A token is tried only if the ones before it were kept; the bar rises with the batch
    (n / (n + overhead_rows)); a record that clears it drafts the tokens that clear it too, one
    below it none (the sequence only guesses)."""
    spec = SpeculationConfig(4)
    assert spec.min_acceptance(8) == pytest.approx(8 / 13)
    assert spec.min_acceptance(32) == pytest.approx(32 / 37)
    record = Acceptance()
    assert record.rate == 0.75  # the prior: one token at 8 sequences (0.75^2 < 8 / 13)
    assert spec.draft_length(record, 8) == 1 and spec.draft_length(record, 32) == 0
    record.record(4, 1)  # the second token refused: two tried, one kept
    assert (record.kept, record.tried) == (0.75 * 1.5 + 1, 0.75 * 2 + 2)
    for _ in range(8):
        record.record(4, 4)
    assert record.rate > 0.95 and spec.draft_length(record, 32) == 4
    assert SpeculationConfig(2).draft_length(record, 32) == 2  # never past num_tokens
    record.record(4, 0)  # a miss at the first token: shorter drafts in a large batch
    assert 0.9 < record.rate < 0.92 and spec.draft_length(record, 32) == 1
    assert spec.draft_length(record, 8) == 4
    for _ in range(4):
        record.record(1, 0)  # guesses that were wrong
    assert record.rate < 8 / 13 and spec.draft_length(record, 8) == 0
    with pytest.raises(ValueError, match="overhead_rows"):
        SpeculationConfig(4, overhead_rows=0)
