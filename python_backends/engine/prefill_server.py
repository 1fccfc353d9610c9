"""A prefill instance: computes prompts in batches and leases their KV blocks to decoders.

Free of Triton (`serving.prefill` wires it to requests). The caller's thread runs the engine;
a reaper thread frees leased blocks when a puller releases them or the lease runs out, and, for
NIXL, keeps the agent progressing while leases are out (the puller's READs need it).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from python_backends.cancel_board import CancelBoard
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.sequence import FinishReason, SamplingParams, Sequence
from python_backends.kv_transfer.base import KVHandle, KVSource
from python_backends.kv_transfer.leases import LeaseTable, Reaped

log = logging.getLogger(__name__)
POLL_BUSY_S = 0.001  # reaper period while leases are out
POLL_IDLE_S = 0.02


@dataclass(frozen=True)
class PrefillJob:
    prompt_ids: list[int]
    params: SamplingParams
    transport: str = ""  # "" = the server's default transport
    fault: str = ""  # python_backends.protocol.KV_FAULTS
    priority: int = 0
    tenant: str = "default"


@dataclass(frozen=True)
class PrefillResult:
    token_id: int
    logprob: float
    finish_reason: FinishReason | None  # set when the first token already ends the sequence
    handle: KVHandle | None  # the leased KV when the sequence goes on
    seconds: float  # this job's batch: from start to first token


class PrefillServer:
    def __init__(
        self, engine: LLMEngine, sources: dict[str, KVSource], owner: str,
        lease_s: float = 30.0, on_reaped: Callable[[int], None] = lambda _expired: None,
    ) -> None:
        """`on_reaped(num_expired)`: called on the reaper thread after leases were freed."""
        if not sources:
            raise ValueError("a prefill server needs at least one KV transport")
        self.engine = engine
        self.sources = sources
        self.default_transport = next(iter(sources))
        self.owner = owner
        self.lease_s = lease_s
        self._on_reaped = on_reaped
        self.board = CancelBoard.create()  # release flags, one ticket per lease
        self.leases = LeaseTable(self.board)
        self.num_released = 0
        self.num_expired = 0
        self._lock = threading.Lock()  # the engine's block manager and the lease table
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="kv-reaper", daemon=True)

    def start(self) -> None:
        self._reaper.start()

    def prefill(self, jobs: list[PrefillJob]) -> list[PrefillResult | Exception]:
        """Run the jobs' prompts as one batch; per job, a result or why it was refused."""
        start = time.monotonic()
        seqs: dict[int, Sequence] = {}
        out: list[PrefillResult | Exception] = []
        with self._lock:
            for i, job in enumerate(jobs):
                if job.transport and job.transport not in self.sources:
                    out.append(ValueError(f"KV transport {job.transport!r} is not enabled here "
                                          f"(enabled: {', '.join(self.sources)})"))
                    continue
                try:
                    seqs[i] = self.engine.add_request(
                        uuid.uuid4().hex, job.prompt_ids, job.params, job.priority, job.tenant,
                        prefill_only=True,
                    )
                except ValueError as e:
                    out.append(e)
                    continue
                out.append(ValueError("not run"))  # replaced by the result below
        while not all(s.is_finished for s in seqs.values()):
            with self._lock:
                stepped = self.engine.step()
            if not stepped:  # every block leased: wait for releases or expiries
                time.sleep(POLL_BUSY_S)
        seconds = time.monotonic() - start
        with self._lock:
            for i, seq in seqs.items():
                out[i] = self._result(seq, jobs[i], seconds)
        return out

    def _result(self, seq: Sequence, job: PrefillJob, seconds: float) -> PrefillResult:
        token, logprob = seq.output_ids[0], (seq.output_logprobs or [0.0])[0]
        if seq.finish_reason is not None:  # done at its first token; blocks already freed
            return PrefillResult(token, logprob, seq.finish_reason, None, seconds)
        transport = job.transport or self.default_transport
        lease = self.leases.grant(seq.block_table, 0.0 if job.fault == "expire_lease"
                                  else self.lease_s)
        handle = KVHandle(
            transport=transport,
            owner=self.owner,
            layout=self.engine.kv_layout,
            block_ids=lease.blocks,
            num_tokens=seq.num_computed_tokens,
            deadline=lease.deadline,
            release_board=self.board.name,
            release_ticket=lease.ticket,
            location=self.sources[transport].location(),
            fault=job.fault if job.fault == "transfer_error" else "",
        )
        seq.block_table = []
        return PrefillResult(token, logprob, None, handle, seconds)

    def reap(self) -> list[Reaped]:
        """Free the blocks of released and expired leases."""
        released = [t for source in self.sources.values() for t in source.released()]
        with self._lock:
            reaped = self.leases.reap(released)
            for r in reaped:
                self.engine.blocks.release(list(r.lease.blocks))
                if r.expired:
                    self.num_expired += 1
                    log.warning("KV lease %d expired: freed %d blocks a decoder never released",
                                r.lease.ticket, len(r.lease.blocks))
                else:
                    self.num_released += 1
        if reaped:
            self._on_reaped(sum(r.expired for r in reaped))
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
        for source in self.sources.values():
            source.close()
        self.board.close()
