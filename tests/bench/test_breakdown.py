"""The arithmetic of a breakdown: CPU per token by process name, engine phases per token."""

from __future__ import annotations

from collections.abc import Callable

from python_backends.bench.breakdown import (
    ACCEPTED_METRIC,
    DRAFT_METRIC,
    HELPER_BOOSTED_METRIC,
    HELPER_CHUNKS_METRIC,
    KERNEL_CHUNKS_METRIC,
    STEP_PHASES_METRIC,
    Snapshot,
    breakdown,
    format_breakdown,
)
from python_backends.metrics_text import Metrics


def phases(**seconds: float) -> Metrics:
    return {STEP_PHASES_METRIC: {
        frozenset({("model", "worker"), ("instance", f"worker_0_{i}"), ("phase", phase)}): s / 2
        for phase, s in seconds.items() for i in range(2)}}


def test_breakdown_per_token() -> None:
    names = {1: "tritonserver", 2: "front", 3: "worker", 4: "worker"}
    before = Snapshot({1: 10.0, 2: 5.0, 3: 100.0, 4: 50.0}, names, phases(forward=1.0, sample=0))
    # pid 5 started during the load (counted from 0), pid 4 ended (left out).
    after_names = {1: "tritonserver", 2: "front", 3: "worker", 5: "worker"}
    after = Snapshot({1: 10.5, 2: 5.25, 3: 101.0, 5: 1.0}, after_names,
                     phases(forward=3.0, sample=0.1))
    b = breakdown(before, after, tokens=1000, wall_s=2.0)
    assert b.cpu_ms == {"tritonserver": 0.5, "front": 0.25, "worker": 2.0}
    assert b.phases_ms == {"worker": {"forward": 2.0, "sample": 0.1}}
    text = format_breakdown(b, cores=2)
    assert "4.00 core-ms per token" in text and "forward 2.00, sample 0.10" in text


def test_idle_engines_are_left_out() -> None:
    snap = Snapshot({1: 1.0}, {1: "tritonserver"}, phases(forward=1.0))
    assert breakdown(snap, snap, tokens=10, wall_s=1.0).phases_ms == {}


def counters(first: str, second: str) -> Callable[[float, float], Metrics]:
    """Metrics of the worker: two counters at the values given, and a forward phase that moves
    with the first (so the engine counts as busy between two snapshots where it grew)."""
    labels = frozenset({("model", "worker"), ("instance", "worker_0_0")})

    def metrics(a: float, b: float) -> Metrics:
        return {**phases(forward=a / 100), first: {labels: a}, second: {labels: b}}

    return metrics


def test_the_helpers_share_of_kernel_chunks_over_the_load() -> None:
    metrics = counters(KERNEL_CHUNKS_METRIC, HELPER_CHUNKS_METRIC)
    names = {1: "worker"}
    b = breakdown(Snapshot({1: 0.0}, names, metrics(1000, 100)),
                  Snapshot({1: 1.0}, names, metrics(3000, 900)), tokens=10, wall_s=1.0)
    assert b.helper_share == {"worker": 0.4}  # 800 of the load's 2000 chunks
    assert "worker idle-CPU helper: 40% of the native kernels' work chunks" in format_breakdown(
        b, cores=2)
    assert b.helper_boosted == {"worker": 0}  # no heavy-job counter: none
    # no kernel chunks (torch ops, a GPU engine): no line
    flat = Snapshot({1: 0.0}, names, metrics(1000, 100))
    moved = Snapshot({1: 1.0}, names, {**metrics(1000, 100), **phases(forward=20.0)})
    assert breakdown(flat, moved, tokens=10, wall_s=1.0).helper_share == {}


def test_the_helpers_heavy_jobs_over_the_load() -> None:
    metrics = counters(KERNEL_CHUNKS_METRIC, HELPER_BOOSTED_METRIC)
    names = {1: "worker"}
    b = breakdown(Snapshot({1: 0.0}, names, metrics(1000, 5)),
                  Snapshot({1: 1.0}, names, metrics(3000, 17)), tokens=10, wall_s=1.0)
    assert b.helper_boosted == {"worker": 12}
    assert "; 12 prompts' jobs at normal priority" in format_breakdown(b, cores=2)


def test_speculative_drafts_over_the_load() -> None:
    metrics = counters(DRAFT_METRIC, ACCEPTED_METRIC)
    names = {1: "worker"}
    b = breakdown(Snapshot({1: 0.0}, names, metrics(100, 50)),
                  Snapshot({1: 1.0}, names, metrics(500, 350)), tokens=1000, wall_s=1.0)
    assert b.drafts == {"worker": (400, 300)}
    assert ("worker speculative drafts: 400 drafted, 300 kept (75%); kept drafts were 30% of "
            "the output tokens") in format_breakdown(b, cores=2)
    same = Snapshot({1: 1.0}, names, {**metrics(100, 50), **phases(forward=9.0)})
    assert breakdown(Snapshot({1: 0.0}, names, metrics(100, 50)), same, tokens=10,
                     wall_s=1.0).drafts == {}  # none drafted during the load: no line
