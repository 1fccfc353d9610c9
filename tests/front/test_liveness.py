"""IdleProber probes only requests that went quiet; HolderWatch tells a dead engine from a live
or not-yet-arrived one."""

from __future__ import annotations

from python_backends.flag_board import FlagBoard
from python_backends.front.liveness import HolderWatch, IdleProber
from tests.conftest import Clock


class Link:
    def __init__(self, last_sent: float) -> None:
        self.last_sent = last_sent
        self.probes = 0

    def idle_for(self, now: float) -> float:
        return now - self.last_sent

    def probe(self) -> None:
        self.probes += 1


def test_only_requests_quiet_for_the_interval_are_probed() -> None:
    clock = Clock()
    prober = IdleProber(1.0, clock=clock)
    quiet, busy = Link(0.0), Link(0.0)
    prober.add(quiet)
    prober.add(busy)
    clock.t = 0.5
    assert prober.probe_idle() == 0
    clock.t = 1.2
    busy.last_sent = 1.0
    assert prober.probe_idle() == 1 and (quiet.probes, busy.probes) == (1, 0)
    prober.discard(quiet)
    clock.t = 5.0
    assert prober.probe_idle() == 1 and (quiet.probes, busy.probes) == (1, 1)


def test_the_prober_thread_probes_and_stops() -> None:
    prober = IdleProber(0.02)
    link = Link(-10.0)
    prober.add(link)
    prober.start()
    try:
        import time

        deadline = time.monotonic() + 5
        while link.probes < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        prober.close()
    assert link.probes >= 2


def test_holder_watch_reports_only_a_dead_holder() -> None:
    board = FlagBoard.create(size=4)
    try:
        ticket = board.acquire()
        alive = {111: True, 222: False}
        watch = HolderWatch(board, ticket, running=lambda pid: alive[pid])
        assert not watch.engine_gone()  # no engine took the request yet
        board.hold(ticket, 111)
        assert watch.holder() == 111 and not watch.engine_gone()
        board.hold(ticket, 222)
        assert watch.engine_gone()
        watch.clear()  # the next call: nobody holds it until an engine says so
        assert watch.holder() == 0 and not watch.engine_gone()
    finally:
        board.close()
