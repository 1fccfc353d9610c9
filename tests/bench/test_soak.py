"""The soak's bookkeeping: outcomes by kind, a lost request told from a hung one, and the
server processes' memory."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest
import requests

from python_backends import procfs
from python_backends.bench import soak
from python_backends.bench.soak import (
    DeadStubs,
    FaultLog,
    LoadWatch,
    MemoryWatch,
    Outcome,
    Tally,
    format_load,
    held_by_instance,
    unanswered,
    wait_engines_idle,
)
from python_backends.metrics_text import metric_sum


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


def test_an_unanswered_request_is_lost_with_the_server_or_front_before_it_is_hung() -> None:
    assert unanswered(server_alive=True, front_killed=False) is Outcome.HUNG
    assert unanswered(server_alive=True, front_killed=True) is Outcome.LOST_WITH_FRONT
    assert unanswered(server_alive=False, front_killed=False) is Outcome.LOST_WITH_SERVER
    assert unanswered(server_alive=False, front_killed=True) is Outcome.LOST_WITH_SERVER
    assert Outcome.LOST_WITH_SERVER not in soak.BAD_OUTCOMES  # server_died fails the run


def test_tally_counts_by_outcome_and_kind_and_keeps_a_few_examples() -> None:
    tally = Tally()
    for i in range(7):
        tally.add("stream", Outcome.MISMATCHED, f"case {i}")
    tally.add("unary", Outcome.COMPLETED, "ignored")
    assert tally.counts == {"mismatched": 7, "completed": 1}
    assert tally.by_kind["stream/mismatched"] == 7
    assert tally.examples == {"mismatched": [f"stream: case {i}" for i in range(5)]}


def test_memory_is_reported_per_process_and_a_process_gone_is_marked_exited() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        watch = MemoryWatch(warmup_s=0.0)
        watch.sample(os.getpid())  # this process plays the server, the child its stub
        child.kill()
        child.wait()
        watch.sample(os.getpid())
    finally:
        child.kill()
    rows = {r["pid"]: r for r in watch.report()}
    assert not rows[os.getpid()]["exited"] and rows[child.pid]["exited"]
    me = rows[os.getpid()]
    assert me["after_warmup_mb"] > 10 and {"private_growth_mb", "shared_growth_mb"} <= set(me)
    exited = [r["exited"] for r in watch.report()]
    assert exited == sorted(exited)  # the exited ones last


def test_growth_in_the_second_half_tells_settled_memory_from_growing() -> None:
    watch = MemoryWatch(warmup_s=0.0)
    mib = 2**20
    # grew 100 MiB early, then held: settled
    watch._rss[1] = [(0.0, 100 * mib), (5.0, 200 * mib), (10.0, 200 * mib), (20.0, 200 * mib)]
    # grew steadily
    watch._rss[2] = [(float(t), (100 + 5 * t) * mib) for t in range(21)]
    assert watch._second_half_growth(1) == 0.0
    assert watch._second_half_growth(2) == 50.0
    assert watch._second_half_growth(3) == 0.0  # never sampled after its warm-up


def test_tritonserver_s_segments_of_dead_stubs_are_told_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """This process plays tritonserver mapping two stub segments; one stub is alive."""
    import mmap
    import uuid

    from python_backends.procfs import STUB_SEGMENT_PREFIX, Stub

    names = [f"{STUB_SEGMENT_PREFIX}test_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    regions = []
    try:
        for name, pages in zip(names, (2, 5), strict=True):
            with open(f"/dev/shm/{name}", "w+b") as f:
                f.truncate(8 * 4096)
                regions.append(mmap.mmap(f.fileno(), 8 * 4096))
            regions[-1][:pages * 4096] = b"x" * (pages * 4096)
        monkeypatch.setattr(soak, "live_stubs",
                            lambda pid: [Stub(1, "worker", "worker_0_0", region=names[0])])
        dead = DeadStubs.of(os.getpid())
    finally:
        for region in regions:
            region.close()
        for name in names:
            os.unlink(f"/dev/shm/{name}")
    assert (dead.segments, dead.resident) == (1, 5 * 4096) and dead.threads >= 1
    mib = 2**20
    base = procfs.Memory(anon=60 * mib, file=30 * mib, shmem=10 * mib)
    end = procfs.Memory(anon=70 * mib, file=30 * mib, shmem=30 * mib)
    fields = DeadStubs(300, 0, 0).compare(DeadStubs(900, 2, 20 * mib), base, end)
    assert fields == {"threads": [300, 900], "dead_stub_segments": [0, 2],
                      "dead_stub_segments_mb": [0.0, 20.0],
                      "growth_without_dead_stub_segments_pct": 10.0}


def test_an_instance_holding_kv_blocks_reports_its_sequences_too() -> None:
    def series(**values: float) -> dict[frozenset[tuple[str, str]], float]:
        return {frozenset({("model", i.split("_")[0]), ("instance", i)}): v
                for i, v in values.items()}

    metrics = {"llm_kv_cache_blocks_used": series(worker_0_0=175.0, decode_0_0=0.0),
               "llm_num_requests_running": series(worker_0_0=0.0, decode_0_0=0.0),
               "llm_num_requests_waiting": series(worker_0_0=0.0),
               "llm_engine_healthy": series(worker_0_0=1.0)}
    assert held_by_instance(metrics) == {"worker_0_0": {
        "blocks": 175.0, "num_requests_running": 0.0, "num_requests_waiting": 0.0,
        "engine_healthy": 1.0}}


class _Drain:
    """Scrapes of a server whose engines hold `blocks` while their busy time grows `busy`
    (one value per scrape; the last repeats), on a clock that a sleep advances."""

    def __init__(self, blocks: list[float], busy: list[float]) -> None:
        self.blocks, self.busy, self.now, self.scrapes = blocks, busy, 0.0, 0

    def scrape(self) -> dict[str, Any]:
        i, self.scrapes = self.scrapes, self.scrapes + 1
        labels = frozenset({("instance", "worker_0_0")})
        return {"llm_kv_cache_blocks_used": {labels: self.blocks[min(i, len(self.blocks) - 1)]},
                "llm_engine_busy_seconds_total": {labels: self.busy[min(i, len(self.busy) - 1)]}}

    def wait(self, **kw: float) -> tuple[float, float]:
        def sleep(s: float) -> None:
            self.now += s

        metrics, waited = wait_engines_idle(self.scrape, clock=lambda: self.now, sleep=sleep,
                                            **kw)
        return metric_sum(metrics, "llm_kv_cache_blocks_used"), waited


def test_the_end_waits_for_engines_that_still_compute_their_last_requests() -> None:
    # 100 s of an abandoned request running to its end, then idle: waited for, nothing held
    drain = _Drain(blocks=[25.0] * 100 + [0.0], busy=[float(t) for t in range(101)])
    assert drain.wait(stall_s=30.0, timeout_s=600.0) == (0.0, 100.0)


def test_blocks_held_by_engines_that_compute_nothing_are_reported_after_the_stall() -> None:
    drain = _Drain(blocks=[40.0], busy=[7.0])
    assert drain.wait(stall_s=30.0, timeout_s=600.0) == (40.0, 30.0)
    # computing for ever (a runaway sequence) ends at the timeout, with its blocks reported
    endless = _Drain(blocks=[12.0], busy=[float(t) for t in range(1000)])
    assert endless.wait(stall_s=30.0, timeout_s=120.0) == (12.0, 120.0)


def test_an_idle_server_is_not_waited_for() -> None:
    assert _Drain(blocks=[0.0], busy=[3.0]).wait() == (0.0, 0.0)


def test_the_load_timeline_samples_each_group_at_its_interval_and_survives_a_failed_scrape(
) -> None:
    def series(**values: float) -> dict[frozenset[tuple[str, str]], float]:
        return {frozenset({("model", i.split("_")[0]), ("instance", i)}): v
                for i, v in values.items()}

    scrapes: list[dict[str, Any] | None] = [
        {"llm_num_requests_running": series(worker_0_0=3.0, worker_0_1=2.0, decode_0_0=1.0),
         "llm_num_requests_waiting": series(worker_0_0=4.0),
         "llm_kv_cache_blocks_used": series(worker_0_0=30.0, prefill_0_0=6.0),
         "llm_num_preemptions_total": series(worker_0_0=2.0, decode_0_0=1.0)},
        None,  # the server is busy restarting a stub: no sample, no error
        {},
    ]

    def scrape() -> dict[str, Any]:
        got = scrapes.pop(0)
        if got is None:
            raise requests.ConnectionError("refused")
        return got

    watch = LoadWatch(scrape, interval_s=10.0)
    first = watch.sample(0.0)
    assert first == {"at_s": 0.0, "running": {"worker": 5.0, "prefill": 0.0, "decode": 1.0},
                     "waiting": {"worker": 4.0, "prefill": 0.0, "decode": 0.0},
                     "kv_blocks": {"worker": 30.0, "prefill": 6.0, "decode": 0.0},
                     "preemptions": 3.0}
    assert watch.sample(5.0) is None  # not due: nothing scraped
    assert watch.sample(10.0) is None  # due, but the scrape failed
    assert watch.sample(12.0, force=True) is not None  # a hang asks for one now
    assert [row["at_s"] for row in watch.samples] == [0.0, 12.0] and not scrapes
    assert format_load(first) == ("    0.0 s  worker 5/4/30  prefill 0/0/6  decode 1/0/0  "
                                  "preemptions 3")
