"""scripts/bench_sweep.py's options that need no server (the sweeps themselves run against real
servers: docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    return load_script("bench_sweep")


@pytest.mark.parametrize("argv,want", [
    ([], (32, 32)),  # the highest level, as many requests as its concurrency
    (["--warmup-requests", "5"], (32, 5)),
    (["--warmup-requests", "0"], (32, 0)),  # none
    (["--warmup-requests", "-3"], (32, 0)),
])
def test_warm_up_runs_the_highest_level(sweep: ModuleType, argv: list[str],
                                        want: tuple[int, int]) -> None:
    args = sweep._parser().parse_args(["--concurrency", "8,32,1", *argv])
    assert sweep._warmup(args, [8, 32, 1]) == want


def test_ratios_per_round_and_their_median_per_level(sweep: ModuleType) -> None:
    def row(rnd: int, target: str, c: int, tok_s: float, ttft: float, itl: float) -> dict:
        return {"round": rnd, "target": target, "concurrency": c, "output_tokens_per_s": tok_s,
                "ttft_p95_ms": ttft, "itl_p50_ms": itl}

    rows = [row(1, "ours", 32, 360.0, 800.0, 80.0), row(1, "vllm", 32, 180.0, 4000.0, 160.0),
            row(2, "vllm", 32, 200.0, 5000.0, 100.0), row(2, "ours", 32, 300.0, 1000.0, 90.0),
            row(3, "ours", 32, 340.0, 900.0, 85.0), row(3, "vllm", 32, 170.0, 4500.0, 170.0),
            row(1, "ours", 8, 250.0, 200.0, 30.0), row(1, "vllm", 8, 125.0, 800.0, 50.0)]
    ratios = sweep.round_ratios(rows, "ours", "vllm")
    assert ratios[(2, 32)] == pytest.approx((1.5, 0.2, 0.9))
    assert set(ratios) == {(1, 32), (2, 32), (3, 32), (1, 8)}
    medians = sweep.median_ratios(ratios)
    assert medians[32] == pytest.approx((2.0, 0.2, 0.5, 3))  # not the mean (1.83)
    assert medians[8] == pytest.approx((2.0, 0.25, 0.6, 1))


def test_chat_prompts_are_handed_out_in_slices_no_earlier_one_sent(sweep: ModuleType,
                                                                  tmp_path: Path) -> None:
    rows = [json.dumps({"prompt": f"question {i}"}) for i in range(10)]
    slices = sweep.PromptSlices(rows, seed=3)
    assert sorted(slices.rows) == sorted(rows) and slices.rows != rows  # one seeded order
    assert sweep.PromptSlices(rows, seed=3).rows == slices.rows
    warm, first, second = slices.take(2), slices.take(3), slices.take(4)
    assert len(set(warm + first + second)) == 9 and not slices.wrapped
    again = slices.take(3)  # one left, then from the start
    assert again == [slices.rows[9], *slices.rows[:2]] and slices.wrapped
    path = sweep.PromptSlices(rows).write(2, tmp_path / "a.jsonl", aiperf=True)
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert [set(r) for r in written] == [{"text"}, {"text"}]
    assert all(r["text"].startswith("question ") for r in written)
    as_is = sweep.PromptSlices(rows).write(2, tmp_path / "v.jsonl").read_text().splitlines()
    assert as_is == sweep.PromptSlices(rows).rows[:2]
    with pytest.raises(ValueError, match="no prompts"):
        sweep.PromptSlices([])


def test_the_shipped_chat_prompts_give_a_sweep_of_one_round_no_repeats(sweep: ModuleType) -> None:
    # warm-up 32, then 32 / 32 / 64 requests at concurrency 1 / 8 / 32: 160 distinct prompts
    slices = sweep.PromptSlices.of_dataset()
    sent = [row for n in (32, 32, 32, 64) for row in slices.take(n)]
    assert len(set(sent)) == len(sent) == 160 and not slices.wrapped
    assert all("prompt" in json.loads(row) for row in slices.rows)
