"""The soak's bookkeeping: outcomes by kind, and a lost request told from a hung one."""

from __future__ import annotations

import time

from python_backends.soak import FaultLog, Outcome, Tally


def test_a_request_in_flight_when_the_front_died_is_lost_not_hung() -> None:
    faults = FaultLog()
    before = time.monotonic()
    faults.record("worker", "killed worker_0_0 (pid 1)")
    assert not faults.front_killed_during(before, time.monotonic())
    faults.record("front", "killed front_0_0 (pid 2)")
    assert faults.front_killed_during(before, time.monotonic())
    assert not faults.front_killed_during(time.monotonic() + 1, time.monotonic() + 2)
    faults.record("front", "skipped: no live stub")
    assert not faults.front_killed_during(faults.events[-1][0], time.monotonic())


def test_tally_counts_by_outcome_and_kind_and_keeps_a_few_examples() -> None:
    tally = Tally()
    for i in range(7):
        tally.add("stream", Outcome.MISMATCHED, f"case {i}")
    tally.add("unary", Outcome.COMPLETED, "ignored")
    assert tally.counts == {"mismatched": 7, "completed": 1}
    assert tally.by_kind["stream/mismatched"] == 7
    assert tally.examples == {"mismatched": [f"stream: case {i}" for i in range(5)]}
