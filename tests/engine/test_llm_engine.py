"""The engine against Hugging Face greedy generation, token for token, in every batching mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from python_backends.config import EngineLimits
from python_backends.engine.llm_engine import LLMEngine, step_budget
from python_backends.engine.scheduler import SchedulerOutput
from python_backends.params import FinishReason, SamplingParams
from tests.conftest import TinyModel, make_tiny_llama, prompts


def run_all(engine: LLMEngine, batch: list[list[int]], n: int) -> list[list[int]]:
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
    while engine.has_unfinished:
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
    assert engine.blocks.num_used == 0
    return [out[str(i)] for i in range(len(batch))]


def test_single_sequence_matches_hf(tiny_llama: TinyModel) -> None:
    p = prompts(1)[0]
    assert run_all(tiny_llama.engine(), [p], 20) == [tiny_llama.greedy(p, 20)]


def test_batch_of_mixed_lengths_matches_hf(tiny_llama: TinyModel) -> None:
    batch = prompts(8, seed=2)
    assert run_all(tiny_llama.engine(), batch, 16) == [tiny_llama.greedy(p, 16) for p in batch]


def test_chunked_prefill_matches_hf(tiny_llama: TinyModel) -> None:
    batch = prompts(4, seed=3, lo=30, hi=60)
    engine = tiny_llama.engine()
    engine.scheduler.limits = EngineLimits(
        max_seq_len=256, max_num_seqs=16, max_num_batched_tokens=7, block_size=4
    )
    assert run_all(engine, batch, 10) == [tiny_llama.greedy(p, 10) for p in batch]


def test_step_budget_is_the_engines_limit_unless_set_lower() -> None:
    assert step_budget(2048) == 2048
    assert step_budget(2048, step_tokens=512) == 512
    assert step_budget(2048, step_tokens=4096) == 2048  # never past what the engine was built for
    with pytest.raises(ValueError, match="step_tokens"):
        step_budget(2048, step_tokens=-1)


def test_steps_compute_at_most_the_budget_set_at_load(tiny_llama: TinyModel) -> None:
    """`step_tokens` from the model's parameters bounds every step: a batch of prompts longer
    than it is prefilled over several steps, each within it, with output unchanged."""
    batch = prompts(6, seed=5, lo=20, hi=40)
    engine = tiny_llama.engine(step_tokens=24)
    assert engine.scheduler.limits.max_num_batched_tokens == 24
    computed: list[int] = []
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput:
        out = schedule()
        computed.append(out.num_tokens)
        return out

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    assert run_all(engine, batch, 8) == [tiny_llama.greedy(p, 8) for p in batch]
    assert max(computed) == 24 and sum(computed) >= sum(map(len, batch))


def test_preemption_by_recompute_keeps_output(tiny_llama: TinyModel) -> None:
    batch = prompts(6, seed=4, lo=10, hi=20)
    engine = tiny_llama.engine(num_kv_blocks=24)  # far fewer than 6 x (20 + 24) / 4 tokens
    preempted = 0
    original_schedule = engine.scheduler.schedule

    def counting_schedule():
        nonlocal preempted
        out = original_schedule()
        preempted += len(out.preempted)
        return out

    engine.scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    assert run_all(engine, batch, 24) == [tiny_llama.greedy(p, 24) for p in batch]
    assert preempted > 0


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    ],
)
def test_rope_scaling_matches_hf(tmp_path: Path, rope: dict[str, object]) -> None:
    model = make_tiny_llama(tmp_path / "e", seed=5, rope_parameters=rope)
    batch = prompts(3, seed=6, lo=60, hi=120)
    assert run_all(model.engine(), batch, 12) == [model.greedy(p, 12) for p in batch]


def test_tied_embeddings_and_single_kv_head_match_hf(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "e", seed=9, tie_word_embeddings=True,
                            num_key_value_heads=1)
    batch = prompts(3, seed=8)
    assert run_all(model.engine(), batch, 12) == [model.greedy(p, 12) for p in batch]


def test_stops_on_end_id_and_stop_sequence(tiny_llama: TinyModel) -> None:
    p = prompts(1, seed=10)[0]
    ref = tiny_llama.greedy(p, 12)
    engine = tiny_llama.engine()
    engine.add_request("end", p, SamplingParams(max_tokens=12, end_ids=(ref[4],)))
    engine.add_request("stop", p, SamplingParams(max_tokens=12,
                                                 stop_sequences=(tuple(ref[5:7]),)))
    engine.add_request("min", p, SamplingParams(max_tokens=12, end_ids=(ref[0],), min_tokens=3))
    got: dict[str, list[int]] = {"end": [], "stop": [], "min": []}
    reasons = {}
    while engine.has_unfinished:
        for ev in engine.step():
            got[ev.seq_id].append(ev.token_id)
            if ev.finish_reason:
                reasons[ev.seq_id] = ev.finish_reason
    first_end = ref.index(ref[4])
    assert got["end"] == ref[: first_end + 1] and reasons["end"] is FinishReason.STOP
    assert got["stop"][-2:] == ref[5:7] and reasons["stop"] is FinishReason.STOP
    assert len(got["min"]) >= 3 and ref[0] not in got["min"][:2]
    assert engine.blocks.num_used == 0


def test_abort_frees_blocks(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine()
    for i, p in enumerate(prompts(4, seed=11)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_used > 0
    for i in range(4):
        seq = engine.abort(str(i))
        assert seq is not None and seq.finish_reason is FinishReason.CANCELLED
    assert engine.blocks.num_used == 0 and not engine.has_unfinished


def test_higher_priority_preempts_and_every_output_stays_exact(tiny_llama: TinyModel) -> None:
    from python_backends.engine.waiting_queue import PriorityFairQueue

    engine = tiny_llama.engine(waiting=PriorityFairQueue())
    engine.scheduler.limits = EngineLimits(
        max_seq_len=256, max_num_seqs=2, max_num_batched_tokens=256, block_size=4
    )
    low = prompts(2, seed=30)
    high = prompts(1, seed=31)[0]
    for i, p in enumerate(low):
        engine.add_request(f"low{i}", p, SamplingParams(max_tokens=20), priority=0)
    out: dict[str, list[int]] = {"low0": [], "low1": [], "high": []}
    for _ in range(3):  # the batch is full of low-priority decodes
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
    engine.add_request("high", high, SamplingParams(max_tokens=5), priority=9)
    first = engine.step()
    assert "high" in {ev.seq_id for ev in first}  # admitted at once, not after the low ones
    assert engine.scheduler.num_preemptions == 1
    for ev in first:
        out[ev.seq_id].append(ev.token_id)
    while engine.has_unfinished:
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
    assert out["high"] == tiny_llama.greedy(high, 5)
    assert [out["low0"], out["low1"]] == [tiny_llama.greedy(p, 20) for p in low]
    assert engine.blocks.num_used == 0


def test_tenants_share_generated_tokens_fairly_while_backlogged(tiny_llama: TinyModel) -> None:
    from python_backends.engine.waiting_queue import PriorityFairQueue

    def run(weights: dict[str, float]) -> dict[str, int]:
        engine = tiny_llama.engine(num_kv_blocks=256, waiting=PriorityFairQueue(weights, 32))
        engine.scheduler.limits = EngineLimits(
            max_seq_len=256, max_num_seqs=4, max_num_batched_tokens=256, block_size=4
        )
        n = 0
        for tenant, count in (("a", 100), ("b", 10) if not weights else ("b", 100)):
            for p in prompts(count, seed=40 + n, lo=8, hi=9):
                engine.add_request(f"{tenant}{n}", p, SamplingParams(max_tokens=8),
                                   tenant=tenant)
                n += 1
        tokens = {"a": 0, "b": 0}
        while {s.tenant for s in engine.scheduler.waiting} == {"a", "b"}:  # both backlogged
            for ev in engine.step():
                tokens[ev.seq_id[0]] += 1
        return tokens

    equal = run({})
    assert abs(equal["a"] - equal["b"]) <= 0.15 * (equal["a"] + equal["b"]) / 2
    weighted = run({"a": 3.0, "b": 1.0})
    assert abs(weighted["a"] / weighted["b"] - 3.0) <= 0.15 * 3.0


def test_a_migrated_sequence_resumes_exactly(tiny_llama: TinyModel) -> None:
    """A request moved off an engine that died arrives with the tokens generated so far
    (Sequence.continue_from): the new engine computes them with the prompt and draws exactly
    the tokens the undisturbed run would have, counting max_tokens across both engines."""
    from python_backends.engine.sequence import Sequence

    p = prompts(1, seed=9)[0]
    want = tiny_llama.greedy(p, 20)
    engine = tiny_llama.engine()
    seq = Sequence("moved", list(p), SamplingParams(max_tokens=20))
    seq.continue_from(want[:7], [0.0] * 7)
    engine.add(seq)
    drawn = []
    while engine.has_unfinished:
        drawn += [ev.token_id for ev in engine.step()]
    assert drawn == want[7:]
    assert seq.finish_reason is FinishReason.LENGTH and engine.blocks.num_used == 0
