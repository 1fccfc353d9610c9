"""BLSStreams: every response reaches the caller; each finished iterator stays referenced until
`hold_s` has passed, so that Python, not the stub's GIL-less thread, frees it; a callee that
announced its pid and then died ends the call with CalleeDied instead of a hang."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import pytest

from python_backends.serving.bls import BLSStreams, CalleeDied
from tests.conftest import Clock


class FakeIterator:
    """What `exec(decoupled=True)` returns: responses, then StopIteration (or, with `block`,
    a wait that never ends while the event is clear, like a call to a dead stub)."""

    def __init__(self, responses: list[str], block: threading.Event | None = None) -> None:
        self._left = list(responses)
        self._block = block
        self.read: list[str] = []

    def __iter__(self) -> FakeIterator:
        return self

    def __next__(self) -> str:
        if not self._left:
            if self._block is not None:
                self._block.wait()
            raise StopIteration
        self.read.append(self._left.pop(0))
        return self.read[-1]


class FakeRequest:
    def __init__(self, iterator: FakeIterator | Exception) -> None:
        self.iterator: FakeIterator | Exception | None = iterator

    def exec(self, decoupled: bool) -> FakeIterator:
        assert decoupled and self.iterator is not None
        it, self.iterator = self.iterator, None  # the request no longer holds it
        if isinstance(it, Exception):
            raise it
        return it


def announced(response: str) -> int | None:
    return int(response[4:]) if response.startswith("pid:") else None


def _wait(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _call(streams: BLSStreams, responses: list[str], stop_after: int | None = None) -> Any:
    """One call; returns (responses seen, weak reference to its iterator)."""
    iterator = FakeIterator(responses)
    ref = weakref.ref(iterator)
    request = FakeRequest(iterator)
    del iterator
    seen = []
    for r in streams.stream(request):
        seen.append(r)
        if stop_after is not None and len(seen) == stop_after:
            break
    return seen, ref


def test_iterators_are_held_until_hold_s_then_freed_by_a_later_call() -> None:
    clock = Clock()
    streams = BLSStreams(announced, hold_s=10.0, clock=clock)
    seen, first = _call(streams, ["pid:1", "a", "b", "final"])
    assert seen == ["a", "b", "final"]  # the announcement is not a response
    gc.collect()
    assert first() is not None and streams.held == 1  # only BLSStreams references it now
    clock.t = 9.9
    _, second = _call(streams, ["x"])
    gc.collect()
    assert first() is not None and streams.held == 2  # not yet: 10 s from its end
    clock.t = 10.0
    _, third = _call(streams, ["y"])
    gc.collect()
    assert first() is None and second() is not None and third() is not None
    assert streams.held == 2
    streams.close()
    gc.collect()
    assert second() is None and third() is None and streams.held == 0


def test_a_caller_that_stops_early_leaves_the_pump_to_finish_the_call() -> None:
    streams = BLSStreams(announced, hold_s=10.0, clock=Clock())
    seen, ref = _call(streams, ["error", "late", "final"], stop_after=1)
    assert seen == ["error"]
    _wait(lambda: streams.held == 1)
    iterator = ref()
    assert iterator is not None and iterator.read == ["error", "late", "final"]


def test_a_failing_exec_raises_in_the_caller() -> None:
    streams = BLSStreams(announced)
    with pytest.raises(RuntimeError, match="model not ready"):
        list(streams.stream(FakeRequest(RuntimeError("model not ready"))))
    assert streams.held == 0


def test_a_callee_that_dies_ends_the_call() -> None:
    """The engine announced its pid, sent a token and died: its iterator never ends."""
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    never = threading.Event()
    streams = BLSStreams(announced, poll_s=0.05)
    try:
        stream = streams.stream(FakeRequest(FakeIterator([f"pid:{engine.pid}", "tok"], never)))
        assert next(stream) == "tok"
        got: list[BaseException] = []

        def rest() -> None:
            try:
                list(stream)
            except BaseException as e:
                got.append(e)

        waiter = threading.Thread(target=rest)
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive()  # a quiet call to a live engine just waits
        engine.kill()  # a zombie until reaped below: gone already
        waiter.join(5)
        assert not waiter.is_alive() and isinstance(got[0], CalleeDied)
        assert got[0].pid == engine.pid and streams.held == 0
    finally:
        engine.kill()
        engine.wait()
        never.set()  # lets the fake pump thread end
