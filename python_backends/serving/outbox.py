"""Responses sent off the engine thread, one ordered lane per caller.

Each send is an IPC round trip to the server; done on the outbox's threads, sends overlap the
engine's next step instead of delaying it. Lanes keep callers apart because in Triton 2.51 a
send to a caller whose stub died never returns (the server waits for the dead stub to take the
response): it must stall only that caller's lane, not every sequence of the instance.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from python_backends.flag_board import FlagBoard

log = logging.getLogger(__name__)


class _Lane:
    """One caller's responses, sent in order by a thread of their own."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name=f"outbox {name}", daemon=True)
        self._thread.start()

    def put(self, send: Callable[[], None]) -> None:
        self._queue.put(send)

    def abandon(self) -> None:
        """Drop what is queued; a send in progress may never return (its thread is left)."""
        self._abandoned = True
        self._queue.put(None)

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (send := self._queue.get()) is not None and not self._abandoned:
            try:
                send()
            except Exception:  # a client that went away must not stop the others' responses
                log.exception("sending a response failed")


class Outbox:
    """Lanes are named by the caller: a front instance's cancel board name, "" for direct
    callers. `retire` drops a dead caller's lane and everything later put on it."""

    def __init__(self, owner: str = "") -> None:
        self.owner = owner  # the instance sending, for log lines
        self._lanes: dict[str, _Lane] = {}
        self._retired: set[str] = set()
        self._lock = threading.Lock()

    def put(
        self, sender: Any, make_response: Callable[[], Any], flags: int = 0, lane: str = ""
    ) -> None:
        with self._lock:
            if lane in self._retired:
                return
            q = self._lanes.get(lane)
            if q is None:
                q = self._lanes[lane] = _Lane(lane or "direct")
        q.put(lambda: sender.send(make_response(), flags=flags))

    def retire(self, lane: str) -> bool:
        """Stop sending on `lane` for good; True the first time."""
        with self._lock:
            if lane in self._retired:
                return False
            self._retired.add(lane)
            q = self._lanes.pop(lane, None)
        if q is not None:
            q.abandon()
        return True

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            lanes = list(self._lanes.values())
            self._lanes.clear()
        deadline = time.monotonic() + timeout
        for q in lanes:
            q.close(max(0.0, deadline - time.monotonic()))


def caller_lane(board: FlagBoard | None) -> str:
    """The lane of a request's caller: its front instance (named by its cancel board), or
    "" for direct callers."""
    return board.name if board is not None else ""


def caller_gone(outbox: Outbox, board: FlagBoard | None) -> bool:
    """Whether the front instance behind `board` died. The first time, its lane is retired
    and its board's file removed, which the owner would have done (the mapping stays valid)."""
    if board is None or board.owner_alive():
        return False
    if outbox.retire(board.name):
        board.path.unlink(missing_ok=True)
        log.warning("%s: caller %s (pid %d) is gone: aborting its sequences, dropping their "
                    "responses", outbox.owner, board.name, board.owner_pid)
    return True
