"""A prefill instance: computes prompts and leases their KV blocks to decode instances.

Free of Triton (`serving.prefill` wires it to requests). Prompts join one continuous batch (an
`EngineLoop` of prefill-only sequences), so a short prompt is answered as soon as its own first
token is drawn, not when a long one submitted with it finishes. Each finished prompt's blocks
go under a lease; a reaper thread watches for releases (the owner's board, NIXL notifications,
which it also keeps progressing) and expiries, and has the loop free those blocks.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from python_backends.engine.engine_loop import EngineListener, EngineLoop
from python_backends.engine.llm_engine import LLMEngine, TokenEvent
from python_backends.engine.sequence import Sequence
from python_backends.flag_board import FlagBoard
from python_backends.kv_transfer.base import KVHandle, KVSource
from python_backends.kv_transfer.leases import LeaseTable, Reaped
from python_backends.params import FinishReason, SamplingParams

log = logging.getLogger(__name__)
POLL_BUSY_S = 0.001  # reaper period while leases are out
POLL_IDLE_S = 0.02


@dataclass(frozen=True)
class PrefillJob:
    prompt_ids: list[int]
    params: SamplingParams
    transport: str = ""  # "" = the server's default transport
    fault: str = ""  # python_backends.front.validation.KV_FAULTS
    priority: int = 0
    tenant: str = "default"
    cache_salt: str = ""  # see Sequence.cache_salt
    # Polled between steps: True aborts the prompt (its done gets "prefill cancelled").
    is_cancelled: Callable[[], bool] = lambda: False


@dataclass(frozen=True)
class PrefillResult:
    token_id: int
    logprob: float
    finish_reason: FinishReason | None  # set when the first token already ends the sequence
    handle: KVHandle | None  # the leased KV when the sequence goes on
    seconds: float  # submission to first token
    event: TokenEvent | None = None  # the engine's event (latencies), when it ran


Done = Callable[[PrefillResult | Exception], None]


@dataclass(frozen=True)
class _Submitted:
    job: PrefillJob
    done: Done
    start: float


class Prefiller(EngineListener):
    """Computes prompts in one continuous batch and leases each finished prompt's KV blocks to
    the decode instance that pulls them."""

    def __init__(
        self, engine: LLMEngine, sources: dict[str, KVSource], owner: str,
        lease_s: float = 30.0, on_reaped: Callable[[int], None] = lambda _expired: None,
        on_step: Callable[[LLMEngine], None] = lambda _engine: None,
    ) -> None:
        """`on_reaped(num_expired)`: after leases were reaped (reaper thread). `on_step`: after
        every engine step and when idle (loop thread)."""
        if not sources:
            raise ValueError("a prefiller needs at least one KV transport")
        self.engine = engine
        self.sources = sources
        self.default_transport = next(iter(sources))
        self.owner = owner
        self.lease_s = lease_s
        self._on_reaped = on_reaped
        self.board = FlagBoard.create()  # release flags, one ticket per lease
        self.leases = LeaseTable(self.board)
        self._leases_lock = threading.Lock()
        self.num_released = 0
        self.num_expired = 0
        self._submitted: dict[str, _Submitted] = {}
        self._on_step = on_step
        self.loop = EngineLoop(engine, self)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="kv-reaper", daemon=True)

    def is_cancelled(self, seq_id: str) -> bool:
        return self._submitted[seq_id].job.is_cancelled()

    def on_step(self, engine: LLMEngine) -> None:
        self._on_step(engine)

    def start(self) -> None:
        self.loop.start()
        self._reaper.start()

    def submit(self, job: PrefillJob, done: Done) -> None:
        """Queue a prompt; `done` gets its result, or why it was refused, on the loop thread."""
        if job.transport and job.transport not in self.sources:
            done(ValueError(f"KV transport {job.transport!r} is not enabled here "
                            f"(enabled: {', '.join(self.sources)})"))
            return
        seq_id = uuid.uuid4().hex
        self._submitted[seq_id] = _Submitted(job, done, time.monotonic())
        self.loop.submit(Sequence(seq_id, list(job.prompt_ids), job.params,
                                  priority=job.priority, tenant=job.tenant, prefill_only=True,
                                  cache_salt=job.cache_salt))

    def prefill(self, jobs: list[PrefillJob], timeout: float = 600.0,
                ) -> list[PrefillResult | Exception]:
        """Submit the jobs together and wait for all results (tests, benchmarks)."""
        results: list[PrefillResult | Exception | None] = [None] * len(jobs)
        left = threading.Semaphore(0)

        def done(i: int, result: PrefillResult | Exception) -> None:
            results[i] = result
            left.release()

        for i, job in enumerate(jobs):
            self.submit(job, partial(done, i))
        for _ in jobs:
            if not left.acquire(timeout=timeout):
                raise TimeoutError("prefill did not finish")
        return [r for r in results if r is not None]

    def on_tokens(self, events: list[TokenEvent]) -> None:
        now = time.monotonic()
        for ev in events:
            submitted = self._submitted.pop(ev.seq_id)
            logprob = ev.logprob or 0.0
            handle = self._lease(ev, submitted.job) if ev.kv_blocks is not None else None
            submitted.done(PrefillResult(ev.token_id, logprob, ev.finish_reason, handle,
                                         now - submitted.start, ev))

    def _lease(self, ev: TokenEvent, job: PrefillJob) -> KVHandle:
        assert ev.kv_blocks is not None
        transport = job.transport or self.default_transport
        duration = 0.0 if job.fault == "expire_lease" else self.lease_s
        with self._leases_lock:
            lease = self.leases.grant(ev.kv_blocks, duration)
        return KVHandle(
            transport=transport,
            owner=self.owner,
            layout=self.engine.handoff.layout,
            block_ids=lease.blocks,
            num_tokens=ev.kv_tokens,
            deadline=lease.deadline,
            release_board=self.board.name,
            release_ticket=lease.ticket,
            location=self.sources[transport].location(),
            fault=job.fault if job.fault == "transfer_error" else "",
        )

    def on_finished_early(self, seq_id: str, error: Exception | None) -> None:
        submitted = self._submitted.pop(seq_id)
        submitted.done(error if error is not None else RuntimeError("prefill cancelled"))

    def reap(self) -> list[Reaped]:
        """Take the released and expired leases off the table; the loop frees their blocks."""
        released = [t for source in self.sources.values() for t in source.released()]
        with self._leases_lock:
            reaped = self.leases.reap(released)
        if not reaped:
            return reaped
        blocks = [b for r in reaped for b in r.lease.blocks]
        self.loop.call(lambda engine: engine.blocks.release(blocks))
        expired = [r for r in reaped if r.expired]
        self.num_expired += len(expired)
        self.num_released += len(reaped) - len(expired)
        for r in expired:
            log.warning("KV lease %d expired: freeing %d blocks no decoder released",
                        r.lease.ticket, len(r.lease.blocks))
        self._on_reaped(len(expired))
        return reaped

    def _reap_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reap()
            except Exception:
                log.exception("reaping KV leases failed")
            self._stop.wait(POLL_BUSY_S if len(self.leases) else POLL_IDLE_S)

    def close(self) -> None:
        self._stop.set()
        if self._reaper.is_alive():
            self._reaper.join(5)
        self.loop.stop()
        for seq_id in list(self._submitted):
            self.on_finished_early(seq_id, RuntimeError("prefill instance shutting down"))
        for source in self.sources.values():
            source.close()
        self.board.close()
