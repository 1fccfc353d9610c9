"""Decoupled BLS calls, with the workaround for a Triton 2.51 crash that they otherwise cause.

The crash: a decoupled BLS call's response iterator has two owners, the Python object its
caller iterates and the stub's own map of live iterators. After the final response the stub
erases its map entry on its stub-to-parent thread, which does not hold the GIL. When that erase
drops the last reference, the iterator's responses are freed on that thread, and with them the
NumPy arrays their tensors keep (2.51's `~PbTensor` does not take the GIL; later releases do).
Python objects freed without the GIL corrupt CPython's small-object allocator, and the stub
segfaults at some later allocation (in libpython), leaving every request it held hanging. The
scheduler, the one model that makes BLS calls, crashed this way about once in a few full test
runs; under gdb, about one iterator in five was destroyed in `Stub::SendCleanupId` with
`PyGILState_Check() == 0`.

The workaround: `BLSStreams.stream` reads each call through its final response, then keeps the
iterator referenced for `hold_s` seconds, far longer than the stub takes to erase its entry
(milliseconds). The reference is then dropped by a Python thread, under the GIL, and it is the
last one. The cost: the responses of the last `hold_s` seconds of calls stay in the stub's
shared-memory pool (a few hundred bytes per response), and after a burst the last ones stay
until the next call or `close`.
"""

from __future__ import annotations

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
