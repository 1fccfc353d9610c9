"""Outbox lanes: a send that never returns (the caller's stub died) stalls only its caller's
lane; a retired lane drops what it has queued and everything put on it later."""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

from python_backends.serving.outbox import Outbox


class Sender:
    def __init__(self, block: threading.Event | None = None) -> None:
        self.sent: list[tuple[Any, int]] = []
        self._block = block
        self.entered = threading.Event()

    def send(self, response: Any, flags: int = 0) -> None:
        self.entered.set()
        if self._block is not None:
            self._block.wait()
        self.sent.append((response, flags))


def _wait(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_stuck_lane_stalls_only_its_caller_and_retiring_drops_its_queue() -> None:
    outbox = Outbox()
    stuck = threading.Event()
    dead, alive, direct = Sender(block=stuck), Sender(), Sender()
    outbox.put(dead, lambda: "d1", 0, lane="board-a")
    assert dead.entered.wait(5)  # its send never returns while `stuck` is clear
    outbox.put(dead, lambda: "d2", 1, lane="board-a")
    for i in range(3):
        outbox.put(alive, partial(str, f"a{i}"), 1 if i == 2 else 0, lane="board-b")
    outbox.put(direct, lambda: "x", 1)
    _wait(lambda: len(alive.sent) == 3 and len(direct.sent) == 1)
    assert alive.sent == [("a0", 0), ("a1", 0), ("a2", 1)] and direct.sent == [("x", 1)]
    assert outbox.retire("board-a") and not outbox.retire("board-a")
    outbox.put(dead, lambda: "d3", 1, lane="board-a")  # dropped: the lane is retired
    stuck.set()  # the stuck send returns after all (it need not) ...
    _wait(lambda: len(dead.sent) == 1)
    time.sleep(0.1)
    assert dead.sent == [("d1", 0)]  # ... and nothing queued behind it, or later, follows
    outbox.put(alive, lambda: "a3", 1, lane="board-b")
    _wait(lambda: len(alive.sent) == 4)
    outbox.close()


def test_close_waits_for_queued_sends_but_not_for_a_stuck_one() -> None:
    outbox = Outbox()
    never = threading.Event()
    stuck, normal = Sender(block=never), Sender()
    outbox.put(stuck, lambda: "s", 0, lane="a")
    assert stuck.entered.wait(5)
    for i in range(5):
        outbox.put(normal, partial(int, i), 0, lane="b")
    start = time.monotonic()
    outbox.close(timeout=0.5)
    assert time.monotonic() - start < 2.0
    assert [r for r, _ in normal.sent] == [0, 1, 2, 3, 4]
    never.set()


def test_a_failing_send_does_not_stop_its_lane() -> None:
    outbox = Outbox()
    ok = Sender()

    class Broken:
        def send(self, response: Any, flags: int = 0) -> None:
            raise RuntimeError("client went away")

    outbox.put(Broken(), lambda: "lost", 0, lane="a")
    outbox.put(ok, lambda: "kept", 1, lane="a")
    _wait(lambda: ok.sent == [("kept", 1)])
    outbox.close()
