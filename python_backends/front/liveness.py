"""Knowing who is still there, in both directions of a request.

Towards the client: Triton 2.51 tells the front nothing when a client goes away; only the
ensemble step scheduled after the cancellation (postprocessing) is marked cancelled. A request
that sends nothing for a while (waiting for its first token) would not learn it, so
`IdleProber` sends each such request a probe now and then: an empty chunk, which the decoupled
postprocessing ends with no response (the client sees nothing) after raising the request's
cancel flag if its client is gone. (A `/generate` client's disconnect stays unseen: Triton's HTTP
front-end notices a closed connection only when it writes; docs/platform.md.) Whether a direct
caller of the front (the gateway) is gone, its request's sender tells before each probe; such a
caller drops the probes it gets.

Towards the engine: Triton 2.51 never ends the calls an engine stub held when it died. Each
engine records its pid on the front's board when a request reaches it (flag_board.hold), and
`HolderWatch` tells from that pid whether the engine holding a request is still alive, so the
front can move the request elsewhere (see front.migration).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from python_backends import procfs
from python_backends.flag_board import FlagBoard


class Probed(Protocol):
    def idle_for(self, now: float) -> float:
        """Seconds since the request last sent its client anything."""

    def probe(self) -> None:
        """Send the client an empty chunk (never after its final response)."""


class IdleProber:
    """Probes every registered request idle for `interval_s`, from a thread of its own."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._links: set[Probed] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, link: Probed) -> None:
        with self._lock:
            self._links.add(link)

    def discard(self, link: Probed) -> None:
        with self._lock:
            self._links.discard(link)

    def probe_idle(self) -> int:
        """Probe the requests idle for the interval; returns how many were probed."""
        now = self._clock()
        with self._lock:
            idle = [link for link in self._links if link.idle_for(now) >= self.interval_s]
        for link in idle:
            link.probe()
        return len(idle)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="idle-prober", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s / 2):
            self.probe_idle()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class HolderWatch:
    """Whether the engine process holding a ticket's request died. The front clears the holder
    (`clear`) before each call to an engine; the engine records itself when the call reaches it."""

    def __init__(self, board: FlagBoard, ticket: int,
                 running: Callable[[int], bool] = procfs.running) -> None:
        self.board = board
        self.ticket = ticket
        self._running = running

    def clear(self) -> None:
        self.board.hold(self.ticket, 0)

    def holder(self) -> int:
        return self.board.holder(self.ticket)

    def engine_gone(self) -> bool:
        """An engine took the request and its process is gone (exited, or a zombie)."""
        pid = self.board.holder(self.ticket)
        return pid != 0 and not self._running(pid)
