"""Decoupled BLS calls, each finished iterator held for a while: Triton 2.51 may otherwise free
it without the GIL and corrupt the stub's heap (docs/platform.md, "Python backend").

`BLSStreams.stream` reads a call through its final response, then keeps the iterator referenced
for `hold_s` seconds (the stub erases its own reference within milliseconds), so the last
reference is dropped by a Python thread, under the GIL.

`Responses` reads one call on a thread of its own, so its caller can wait with a timeout: Triton
2.51 never ends a call whose engine stub died, and a caller blocked in it could never move the
request elsewhere (front.migration). Such a reader stays blocked until the server stops."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any


class BLSStreams:
    def __init__(self, hold_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._held: deque[tuple[float, Any]] = deque()  # (release time, iterator), in order
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return len(self._held)

    def stream(self, request: Any) -> Iterator[Any]:
        """The responses of a decoupled BLS `request` (a `pb_utils.InferenceRequest`). A caller
        that stops early still costs the wait for the rest: they are read and dropped, since
        only a finished iterator can be released safely."""
        responses = request.exec(decoupled=True)
        finished = False
        try:
            yield from responses
            finished = True
        finally:
            if not finished:
                for _ in responses:
                    pass
            self._hold(responses)

    def _hold(self, responses: Any) -> None:
        now = self._clock()
        with self._lock:
            self._held.append((now + self.hold_s, responses))
            expired = []
            while self._held and self._held[0][0] <= now:
                expired.append(self._held.popleft())
        expired.clear()  # the releases happen here, outside the lock

    def close(self) -> None:
        """Release every held iterator (the model is being finalized)."""
        with self._lock:
            held = list(self._held)
            self._held.clear()
        held.clear()


class Responses:
    """The responses of one decoupled BLS call, read by a daemon thread into a queue."""

    END = object()  # `next` returns it after the final response
    _reading = 0  # readers still in their call (those of dead engines never leave it)
    _count_lock = threading.Lock()

    def __init__(self, streams: BLSStreams, request: Any) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with Responses._count_lock:
            Responses._reading += 1
        threading.Thread(target=self._read, args=(streams, request), name="bls-responses",
                         daemon=True).start()

    @classmethod
    def reading(cls) -> int:
        return cls._reading

    def _read(self, streams: BLSStreams, request: Any) -> None:
        try:
            for response in streams.stream(request):
                self._queue.put(response)
        except Exception as e:  # the call itself failed: its caller sees the exception
            self._queue.put(e)
        finally:
            self._queue.put(self.END)
            with Responses._count_lock:
                Responses._reading -= 1

    def next(self, timeout: float) -> Any:
        """The next response, an exception the call raised, or END; raises queue.Empty after
        `timeout` seconds without one."""
        return self._queue.get(timeout=timeout)
