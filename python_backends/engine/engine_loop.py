"""The continuous-batching loop: one thread stepping the engine; requests join and leave
between steps. Free of Triton, so it is tested directly; `serving.generator` and
`engine.prefiller` wire it to their callers through one `EngineListener`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from python_backends.engine.kv_handoff import KVPull
from python_backends.engine.llm_engine import LLMEngine, TokenEvent
from python_backends.engine.ranks import RankFailure
from python_backends.engine.sequence import Sequence

log = logging.getLogger(__name__)
T = TypeVar("T")


def build_off_thread(make: Callable[[], T]) -> T:
    """`make()` run on a thread of its own that exits when it is done; its exception re-raised.

    An engine process must run torch's parallel CPU ops on one long-lived thread only, its
    engine loop. libgomp (torch's OpenMP on Linux) gives every thread that runs a parallel
    region a team of worker threads of its own, and once it manages more threads than there are
    CPUs it stops spinning between regions and puts workers to sleep instead: every one of the
    hundreds of regions in a step then pays a futex wake-up (a decode step half as fast again:
    docs/platform.md, "Figures behind the code"). A thread that exits gives its team back, so
    loading here leaves the loop thread the only team. Keep the main thread (Triton's `execute`)
    free of parallel torch ops for the same reason.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(make())
        except BaseException as e:  # re-raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name="engine-build")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


class EngineListener:
    """What the loop tells its owner; every method runs on the loop thread and must not block.
    Subclasses override `on_tokens` and `on_finished_early`; the others default to nothing."""

    def on_tokens(self, events: list[TokenEvent]) -> None:
        """After a step: one event per sequence that drew a token."""
        raise NotImplementedError

    def on_finished_early(self, seq_id: str, error: Exception | None) -> None:
        """A sequence ended without a token: cancelled (error None), refused (a ValueError: it
        can never fit) or failed (another exception)."""
        raise NotImplementedError

    def is_cancelled(self, seq_id: str) -> bool:
        """Polled for every sequence before each step: True aborts it."""
        return False

    def on_step(self, engine: LLMEngine) -> None:
        """After every step, and about twice a second while idle."""


@dataclass(frozen=True)
class _Add:
    seq: Sequence


@dataclass(frozen=True)
class _Handoff:
    seq: Sequence
    num_kv_tokens: int
    pull: KVPull


@dataclass(frozen=True)
class _RunOnLoop:
    fn: Callable[[LLMEngine], None]


@dataclass(frozen=True)
class _Abort:
    seq_id: str


class EngineLoop:
    """Owns the engine after `start()`: every other thread talks to it through `submit`,
    `submit_handoff`, `abort` and `call`, so the engine itself needs no locks."""

    def __init__(self, engine: LLMEngine, listener: EngineListener) -> None:
        self.engine = engine
        self._listener = listener
        self._inbox: queue.Queue[_Add | _Handoff | _Abort | _RunOnLoop | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.close()

    def submit(self, seq: Sequence) -> None:
        self._inbox.put(_Add(seq))

    def submit_handoff(self, seq: Sequence, num_kv_tokens: int, pull: KVPull) -> None:
        """A sequence another instance prefilled (see KVHandoff.add); `pull` runs on the loop
        thread."""
        self._inbox.put(_Handoff(seq, num_kv_tokens, pull))

    def call(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run `fn(engine)` on the loop thread between steps (e.g. to free blocks)."""
        self._inbox.put(_RunOnLoop(fn))

    def abort(self, seq_id: str) -> None:
        self._inbox.put(_Abort(seq_id))

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while msg is not None:
            self._apply(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, msg: _Add | _Handoff | _Abort | _RunOnLoop) -> None:
        if isinstance(msg, _RunOnLoop):
            try:
                msg.fn(self.engine)
            except Exception:
                log.exception("a call on the engine loop failed")
        elif isinstance(msg, _Abort):
            if self.engine.abort(msg.seq_id) is not None:
                self._listener.on_finished_early(msg.seq_id, None)
        else:
            try:
                if isinstance(msg, _Handoff):
                    self.engine.add_handoff(msg.seq, msg.num_kv_tokens, msg.pull)
                else:
                    self.engine.add(msg.seq)
            except ValueError as e:
                self._listener.on_finished_early(msg.seq.seq_id, e)

    def _cancel_abandoned(self) -> None:
        for seq in self.engine.sequences():
            if self._listener.is_cancelled(seq.seq_id):
                self.engine.abort(seq.seq_id)
                self._listener.on_finished_early(seq.seq_id, None)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:  # a bug must not wedge every request: fail them, keep serving
            log.exception("engine step failed; aborting all sequences")
            # A dead rank goes to the listener as it is: the instance cannot compute any more.
            error = e if isinstance(e, RankFailure) else RuntimeError(f"engine step failed: {e}")
            for seq in self.engine.sequences():
                self.engine.abort(seq.seq_id)
                self._listener.on_finished_early(seq.seq_id, error)
            return
        if events:
            start = time.perf_counter()
            self._listener.on_tokens(events)
            self.engine.step_seconds["respond"] += time.perf_counter() - start

    def _run(self) -> None:
        if self.engine.device.type == "cuda":  # the current CUDA device is per thread
            torch.cuda.set_device(self.engine.device)
        while not self._stopping:
            self._drain(block=not self.engine.has_unfinished)
            if self._stopping:
                break
            self._cancel_abandoned()
            if self.engine.has_unfinished:
                self._step()
            self._listener.on_step(self.engine)
