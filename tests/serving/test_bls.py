"""BLSStreams: every response reaches the caller, and each finished iterator stays referenced
until `hold_s` has passed, so that Python, not the stub's GIL-less thread, frees it."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from python_backends.serving.bls import BLSStreams
from tests.conftest import Clock


class FakeIterator:
    """What `exec(decoupled=True)` returns: responses, then StopIteration."""

    def __init__(self, responses: list[str]) -> None:
        self._left = list(responses)
        self.read: list[str] = []

    def __iter__(self) -> FakeIterator:
        return self

    def __next__(self) -> str:
        if not self._left:
            raise StopIteration
        self.read.append(self._left.pop(0))
        return self.read[-1]


class FakeRequest:
    def __init__(self, responses: list[str]) -> None:
        self.iterator: FakeIterator | None = FakeIterator(responses)

    def exec(self, decoupled: bool) -> FakeIterator:
        assert decoupled and self.iterator is not None
        it, self.iterator = self.iterator, None  # the request no longer holds it
        return it


def _call(streams: BLSStreams, responses: list[str], stop_after: int | None = None) -> Any:
    """One call; returns (responses seen, weak reference to its iterator)."""
    request = FakeRequest(responses)
    assert request.iterator is not None
    ref = weakref.ref(request.iterator)
    seen = []
    for r in streams.stream(request):
        seen.append(r)
        if stop_after is not None and len(seen) == stop_after:
            break
    return seen, ref


def test_iterators_are_held_until_hold_s_then_freed_by_the_next_call() -> None:
    clock = Clock()
    streams = BLSStreams(hold_s=10.0, clock=clock)
    seen, first = _call(streams, ["a", "b", "final"])
    assert seen == ["a", "b", "final"]
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


def test_a_caller_that_stops_early_still_drains_the_call() -> None:
    streams = BLSStreams(hold_s=10.0, clock=Clock())
    seen, ref = _call(streams, ["error", "late", "final"], stop_after=1)
    assert seen == ["error"]
    iterator = ref()
    assert iterator is not None and iterator.read == ["error", "late", "final"]
    assert streams.held == 1


def test_zero_hold_releases_at_once() -> None:
    streams = BLSStreams(hold_s=0.0, clock=Clock())
    _, ref = _call(streams, ["a"])
    gc.collect()
    assert ref() is None and streams.held == 0


class BlockedRequest:
    """A call whose engine died: its iterator never yields (Triton 2.51 never ends it)."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()

    def exec(self, decoupled: bool) -> Any:
        self.release.wait(10)
        return iter(["late"])


def test_answers_come_through_a_queue_and_a_quiet_call_times_out() -> None:
    import queue

    import pytest

    from python_backends.serving.bls import Responses

    streams = BLSStreams(hold_s=0.0)
    answers = Responses(streams, FakeRequest(["a", "b"]))
    assert [answers.next(5), answers.next(5)] == ["a", "b"]
    assert answers.next(5) is Responses.END
    blocked = BlockedRequest()
    quiet = Responses(streams, blocked)
    with pytest.raises(queue.Empty):
        quiet.next(0.05)  # the caller can walk away from it
    blocked.release.set()
    assert quiet.next(5) == "late"
