"""Decoupled BLS calls that survive two Triton 2.51 failure modes: a crash they cause, and a
callee that dies.

The crash: a decoupled BLS call's response iterator has two owners, the Python object its
caller iterates and the stub's own map of live iterators. After the final response the stub
erases its map entry on its stub-to-parent thread, which does not hold the GIL. When that erase
drops the last reference, the iterator's responses are freed on that thread, and with them the
NumPy arrays their tensors keep (2.51's `~PbTensor` does not take the GIL; later releases do).
Python objects freed without the GIL corrupt CPython's small-object allocator, and the stub
segfaults at some later allocation (in libpython), leaving every request it held hanging. The
scheduler, the one model that makes BLS calls, crashed this way about once in a few full test
runs; under gdb, about one iterator in five was destroyed in `Stub::SendCleanupId` with
`PyGILState_Check() == 0`. So each call is read through its final response, and its iterator
is then kept referenced for `hold_s` seconds, far longer than the stub takes to erase its entry
(milliseconds): the reference dropped later by a Python thread, under the GIL, is the last one.
The cost: the responses of the last `hold_s` seconds of calls stay in the stub's shared-memory
pool (a few hundred bytes per response), and after a burst the last ones stay until the next
call or `close`.

The dead callee: a BLS call to an instance whose stub dies never ends (Triton fails nothing,
and the iterator cannot be woken or cancelled). So each call is read by a pump thread of its
own while the caller waits on a queue. Engines announce their pid in a first response (see
`announced_pid`); while a call is quiet, the caller checks that process every `poll_s` and
raises `CalleeDied` when it is gone. The pump of a dead call stays blocked for good: one idle
thread per request that was in flight on the dead instance.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from python_backends import procfs

_END = object()


class CalleeDied(RuntimeError):
    def __init__(self, pid: int) -> None:
        super().__init__(f"the instance serving the request (pid {pid}) died")
        self.pid = pid


def _running(pid: int) -> bool:
    proc = procfs.process(pid)
    return proc is not None and proc.running


class BLSStreams:
    def __init__(
        self,
        announced_pid: Callable[[Any], int | None] = lambda _response: None,
        hold_s: float = 10.0,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        running: Callable[[int], bool] = _running,
    ) -> None:
        """`announced_pid(response)`: the pid a response announces (it is then not yielded),
        else None."""
        self._announced_pid = announced_pid
        self.hold_s = hold_s
        self.poll_s = poll_s
        self._clock = clock
        self._running = running
        self._held: deque[tuple[float, Any]] = deque()  # (release time, iterator), in order
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return len(self._held)

    def stream(self, request: Any) -> Iterator[Any]:
        """The responses of a decoupled BLS `request` (a `pb_utils.InferenceRequest`), less the
        callee's pid announcement. Raises CalleeDied when the announced process is gone and no
        final response came. A caller may stop early: the pump still reads the rest."""
        responses: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._pump, args=(request, responses), name="bls-pump",
                         daemon=True).start()
        pid: int | None = None
        while True:
            try:
                item = responses.get(timeout=self.poll_s)
            except queue.Empty:
                if pid is not None and not self._running(pid):
                    raise CalleeDied(pid) from None
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            announced = self._announced_pid(item)
            if announced is not None:
                pid = announced
                continue
            yield item

    def _pump(self, request: Any, out: queue.SimpleQueue[Any]) -> None:
        try:
            iterator = request.exec(decoupled=True)
            for response in iterator:
                out.put(response)
        except BaseException as e:  # handed to the caller
            out.put(e)
            return
        self._hold(iterator)
        out.put(_END)

    def _hold(self, iterator: Any) -> None:
        now = self._clock()
        with self._lock:
            self._held.append((now + self.hold_s, iterator))
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
