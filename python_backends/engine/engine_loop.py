"""The continuous-batching loop: one thread stepping the engine; requests join and leave
between steps. Free of Triton, so it is tested directly; `serving.worker` wires it to
response senders."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from python_backends.engine.llm_engine import KVFetch, LLMEngine, TokenEvent
from python_backends.engine.params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    tenant: str
    prefill_only: bool = False


@dataclass(frozen=True)
class _Handoff(_Add):
    first_token: int = 0
    first_logprob: float = 0.0
    num_kv_tokens: int = 0
    fetch: KVFetch = lambda _blocks: False


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], None]


@dataclass(frozen=True)
class _Abort:
    seq_id: str


class EngineLoop:
    """Owns the engine after `start()`: every other thread talks to it through `submit` and
    `abort`, so the engine itself needs no locks.

    Callbacks run on the loop thread: `on_tokens` after each step, `on_finished_early` when a
    sequence ends without a token: cancelled (error None), refused (a ValueError: it can never
    fit) or failed (another exception).
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_tokens: Callable[[list[TokenEvent]], None],
        on_finished_early: Callable[[str, Exception | None], None],
        is_cancelled: Callable[[str], bool] = lambda _seq_id: False,
        on_step: Callable[[LLMEngine], None] = lambda _engine: None,
    ) -> None:
        self.engine = engine
        self._on_tokens = on_tokens
        self._on_finished_early = on_finished_early
        self._is_cancelled = is_cancelled
        self._on_step = on_step
        self._inbox: queue.Queue[_Add | _Abort | _Call | None] = queue.Queue()
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

    def submit(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
        priority: int = 0, tenant: str = "default", prefill_only: bool = False,
    ) -> None:
        self._inbox.put(_Add(seq_id, prompt_ids, params, priority, tenant, prefill_only))

    def call(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run `fn(engine)` on the loop thread between steps (e.g. to free blocks)."""
        self._inbox.put(_Call(fn))

    def submit_handoff(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams, first_token: int,
        first_logprob: float, num_kv_tokens: int, fetch: KVFetch, priority: int = 0,
        tenant: str = "default",
    ) -> None:
        """A sequence another instance prefilled (see LLMEngine.add_handoff); `fetch` runs on
        the loop thread."""
        self._inbox.put(_Handoff(seq_id, prompt_ids, params, priority, tenant, False,
                                 first_token, first_logprob, num_kv_tokens, fetch))

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

    def _apply(self, msg: _Add | _Abort | _Call) -> None:
        if isinstance(msg, _Call):
            try:
                msg.fn(self.engine)
            except Exception:
                log.exception("a call on the engine loop failed")
        elif isinstance(msg, _Add):
            try:
                if isinstance(msg, _Handoff):
                    self.engine.add_handoff(
                        msg.seq_id, msg.prompt_ids, msg.first_token, msg.first_logprob,
                        msg.params, msg.num_kv_tokens, msg.fetch, msg.priority, msg.tenant,
                    )
                else:
                    self.engine.add_request(
                        msg.seq_id, msg.prompt_ids, msg.params, msg.priority, msg.tenant,
                        msg.prefill_only,
                    )
            except ValueError as e:
                self._on_finished_early(msg.seq_id, e)
        elif self.engine.abort(msg.seq_id) is not None:
            self._on_finished_early(msg.seq_id, None)

    def _cancel_abandoned(self) -> None:
        for seq in self.engine.sequences():
            if self._is_cancelled(seq.seq_id):
                self.engine.abort(seq.seq_id)
                self._on_finished_early(seq.seq_id, None)

    def _run(self) -> None:
        if self.engine.device.type == "cuda":  # the current CUDA device is per thread
            torch.cuda.set_device(self.engine.device)
        while not self._stopping:
            self._drain(block=not self.engine.has_unfinished)
            if self._stopping:
                break
            self._cancel_abandoned()
            if not self.engine.has_unfinished:
                self._on_step(self.engine)
                continue
            try:
                events = self.engine.step()
            except Exception as e:  # a bug must not wedge every request: fail them, keep serving
                log.exception("engine step failed; aborting all sequences")
                for seq in self.engine.sequences():
                    self.engine.abort(seq.seq_id)
                    self._on_finished_early(seq.seq_id, RuntimeError(f"engine step failed: {e}"))
                events = []
            if events:
                self._on_tokens(events)
            self._on_step(self.engine)
