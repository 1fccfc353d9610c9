"""`worker` and `decode`: a continuous-batching engine instance (decoupled). Requests join the
batch; every step sends each sequence's new tokens back to the caller (the front, over BLS), or
every few steps in big batches (`stream_interval`).

A request may arrive prefilled elsewhere (wire.EngineRequest with a KV handle and first token): the
instance pulls its KV through the handle's transport (the `kv_transports` parameter enables
them) and continues from the first token; if the pull fails it recomputes the prompt. The
`decode` group is this model with transports enabled; `worker` usually has none."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import triton_python_backend_utils as pb_utils

from python_backends.diagnostics import set_up_process
from python_backends.engine.engine_loop import EngineListener, EngineLoop, build_off_thread
from python_backends.engine.kv_handoff import BlocksInDoubt
from python_backends.engine.llm_engine import LLMEngine, TokenEvent
from python_backends.engine.ranks import RankFailure
from python_backends.engine.sequence import Sequence
from python_backends.engine.waiting_queue import PriorityFairQueue
from python_backends.flag_board import BoardCache
from python_backends.kv_transfer.base import Failure, KVHandle, TransferError, abandon
from python_backends.kv_transfer.factory import TransportUnavailable, make_sinks
from python_backends.params import FinishReason
from python_backends.serving.common import (
    FINAL,
    EngineCall,
    ModelArgs,
    ShuttingDown,
    engine_calls,
    engine_path,
    error_response,
    kv_transports,
    response,
)
from python_backends.serving.engine_options import prefix_caching, speculation
from python_backends.serving.metrics import EngineMetrics, KVTransferMetrics
from python_backends.serving.options import DecodeOptions, GeneratorOptions
from python_backends.serving.outbox import Outbox, caller_gone
from python_backends.wire import ErrorKind, TokenStep

log = logging.getLogger(__name__)


@dataclass
class _Caller:
    """Who asked for a sequence (whom to answer, how to tell it was cancelled), and what the
    sequence carries for it."""

    call: EngineCall
    num_prompt_tokens: int
    fault: str = ""  # an injected engine fault (front.validation.ENGINE_FAULTS)
    # A prefilled request's KV handle until its pull takes it: a lease to give back at once
    # if the sequence ends or starts without one (refused, cancelled, no room to pull into).
    handle: KVHandle | None = None
    stream_interval: int = 1  # the request's own; the instance's may raise it
    answered: bool = False  # the client has had a token (this instance's, or prefill's)
    held: list[TokenEvent] = field(default_factory=list)  # tokens not sent yet (stream_interval)

    def fault_due(self, ev: TokenEvent) -> bool:
        """The injected fault strikes at the sequence's first step after its first token."""
        return bool(self.fault) and ev.num_output_tokens > 1 and ev.finish_reason is None

    @property
    def sender(self) -> Any:
        return self.call.sender

    @property
    def lane(self) -> str:
        return self.call.lane


def step_response(step: TokenStep) -> Any:
    return response(step, batched=False)


class GeneratorModel(EngineListener):
    OPTIONS: type[GeneratorOptions] = GeneratorOptions  # the model's parameters

    def initialize(self, args: dict[str, str]) -> None:
        margs = ModelArgs(args)
        set_up_process(margs.instance_name)
        self.name = margs.model_name
        options = margs.options(self.OPTIONS)
        engine = build_off_thread(partial(
            LLMEngine.from_engine_dir,
            engine_path(options.engine_dir),
            num_kv_blocks=options.kv_cache_blocks,
            enable_chunked_prefill=options.enable_chunked_prefill,
            waiting=PriorityFairQueue(options.weights()),
            placement=margs.placement,
            cpu_threads=options.threads,
            step_tokens=options.max_num_batched_tokens, speculation=speculation(options),
            cuda_graphs=options.cuda_graphs, **prefix_caching(options),
        ))
        self.metrics = EngineMetrics(margs.model_name, margs.instance_name)
        self._callers: dict[str, _Caller] = {}
        self._boards = BoardCache()
        transports = kv_transports(margs, options.kv_transports)
        self.kv_metrics = KVTransferMetrics(margs.model_name, margs.instance_name, transports)
        try:
            self._sinks = make_sinks(transports, engine.handoff.layout, engine.handoff.pool,
                                     margs.model_name, self._boards)
        except TransportUnavailable as e:
            raise pb_utils.TritonModelException(f"{margs.model_name}: {e}") from None
        self.drain_timeout_s = options.drain_timeout_seconds
        self.stream_interval = options.interval
        self.outbox = Outbox(margs.instance_name)
        self._restarting = False
        self.loop = EngineLoop(engine, self)
        self.metrics.publish(engine.stats())
        self.loop.start()

    def execute(self, requests: list[Any]) -> None:
        for call in engine_calls(requests, self._boards, self.outbox, self.name):
            msg, req = call.message, call.message.request
            try:
                handle = KVHandle.from_json(msg.kv_handle) if msg.kv_handle else None
            except Exception as e:  # a bug in the caller: answer it, keep serving
                self.outbox.put(call.sender, partial(
                    error_response, f"{self.name}: bad KV handle: {e}"), FINAL, call.lane)
                continue
            seq_id = uuid.uuid4().hex
            # a prefilled request's first token went to the client from the front
            self._callers[seq_id] = _Caller(
                call, len(req.prompt_ids), req.engine_fault, handle,
                stream_interval=req.stream_interval, answered=msg.first_token is not None)
            seq = Sequence(seq_id, list(req.prompt_ids), req.params, priority=req.priority,
                           tenant=req.tenant, cache_salt=req.cache_salt)
            if handle is not None:
                seq.continue_from([msg.first_token or 0], [msg.first_log_prob or 0.0])
                self.loop.submit_handoff(seq, handle.num_tokens, partial(self._pull, seq_id))
                continue
            if msg.resume_ids:  # migrated: the log-probs were sent already, never again
                seq.continue_from(msg.resume_ids, [0.0] * len(msg.resume_ids))
            self.loop.submit(seq)
        return None

    def _pull(self, seq_id: str, blocks: list[int]) -> bool:
        """Pull a handed-off request's KV into `blocks` (engine-loop thread). False: recompute."""
        caller = self._callers[seq_id]
        handle, caller.handle = caller.handle, None
        assert handle is not None
        sink = self._sinks.get(handle.transport)
        reason, in_doubt = "", None
        if sink is None:
            reason = "unsupported"
            log.warning("KV handle over %s, which this instance does not enable; recomputing",
                        handle.transport)
        else:
            start = time.perf_counter()
            try:
                nbytes = sink.pull(handle, blocks)
                self.kv_metrics.transferred(handle.transport, nbytes, time.perf_counter() - start)
                return True
            except TransferError as e:
                reason = e.kind.value
                log.warning("KV pull from %s failed (%s); recomputing", handle.owner, e)
                if e.kind is Failure.IN_DOUBT:
                    in_doubt = e
            except Exception:
                reason = "error"
                log.exception("KV pull from %s failed; recomputing", handle.owner)
        abandon(handle, self._boards)
        self.kv_metrics.failed(handle.transport, reason)
        if in_doubt is not None:  # recompute, but in other blocks
            raise BlocksInDoubt(str(in_doubt)) from in_doubt
        return False

    def is_cancelled(self, seq_id: str) -> bool:
        return self._callers[seq_id].call.is_cancelled()

    def on_step(self, engine: LLMEngine) -> None:
        """Publish the gauges (throttled) and send the lease releases of KV pulled meanwhile."""
        self.metrics.publish_throttled(engine)
        for sink in self._sinks.values():
            try:
                sink.flush()
            except Exception:  # the owner reaps the leases when they expire
                log.exception("sending KV lease releases failed")

    def _release_unpulled(self, caller: _Caller) -> None:
        """Give back the lease of a handed-off request whose KV was never pulled."""
        if caller.handle is not None:
            abandon(caller.handle, self._boards)
            caller.handle = None

    def on_tokens(self, events: list[TokenEvent]) -> None:
        """One response per sequence per step, with every token the step drew for it (several
        when its speculative draft was kept; engine.speculative). With a stream_interval above
        1 (the instance's, options.GeneratorOptions.interval, or the request's if larger) a
        sequence's tokens wait until that many are due, except its first and its last."""
        steps: dict[str, list[TokenEvent]] = {}
        for ev in events:
            caller = self._callers.get(ev.seq_id)
            if caller is None:  # failed by the fault below at an earlier token of this step
                continue
            self._release_unpulled(caller)
            if caller.fault_due(ev):
                self.loop.engine.abort(ev.seq_id)  # on the loop thread: the engine is ours
                steps.pop(ev.seq_id, None)
                self.on_finished_early(ev.seq_id, RuntimeError(
                    "injected engine fault: the step after the first token failed"))
                continue
            self.metrics.observe(ev)
            steps.setdefault(ev.seq_id, []).append(ev)
        interval = self.stream_interval(len(steps))
        for seq_id, evs in steps.items():
            caller = self._callers[seq_id]
            caller.held.extend(evs)
            if (caller.answered and evs[-1].finish_reason is None
                    and len(caller.held) < max(interval, caller.stream_interval)):
                continue
            self._send_held(seq_id, caller)

    def _send_held(self, seq_id: str, caller: _Caller) -> None:
        """The tokens `caller` has not been sent yet, in one response (the last if they end
        the sequence)."""
        evs, caller.held, caller.answered = caller.held, [], True
        last = evs[-1]
        flags = 0
        if last.finish_reason is not None:
            del self._callers[seq_id]
            flags = FINAL
        self.outbox.put(caller.sender, partial(step_response, TokenStep(
            [e.token_id for e in evs], [e.logprob or 0.0 for e in evs],
            last.finish_reason.value if last.finish_reason else "",
            last.num_prompt_tokens, last.num_output_tokens,
            top_ids=[t for e in evs for t, _ in e.top],
            top_log_probs=[lp for e in evs for _, lp in e.top],
        )), flags, caller.lane)

    def on_finished_early(self, seq_id: str, error: Exception | None) -> None:
        caller = self._callers.pop(seq_id)
        self._release_unpulled(caller)
        if isinstance(error, RankFailure):  # whether or not anybody is left to answer
            self._restart_soon()
        if caller_gone(self.outbox, caller.call.board):  # its front died: nobody to answer
            return
        if caller.held and error is not None:  # the tokens drawn before the error go first,
            # so a migration resumes after them (a cancelled sequence's are for nobody)
            self._send_held(seq_id, caller)
        if error is None:
            step = TokenStep([], [], FinishReason.CANCELLED.value, caller.num_prompt_tokens, 0)
        else:  # as data: the front would never see a Triton error after a first response
            kind = (ErrorKind.INVALID if isinstance(error, ValueError)
                    else ErrorKind.UNAVAILABLE if isinstance(error, ShuttingDown | RankFailure)
                    else ErrorKind.INTERNAL)
            step = TokenStep([], [], FinishReason.ERROR.value, caller.num_prompt_tokens, 0,
                             f"{self.name}: {error}", kind.value)
        self.outbox.put(caller.sender, partial(step_response, step), FINAL, caller.lane)

    def _restart_soon(self) -> None:
        """A rank group with a dead rank cannot be mended in place. Its sequences are failed as
        UNAVAILABLE, so the front moves them to a live instance (front.migration); once they are
        answered this stub exits and the watchdog reloads the model with a fresh group."""
        if self._restarting:
            return
        self._restarting = True
        threading.Thread(target=self._exit_for_restart, name="restart", daemon=True).start()

    def _exit_for_restart(self, answer_within_s: float = 10.0) -> None:
        # finalize stops the engine loop before zeroing the gauges: a step published after
        # them would stay on the metrics port for good (Triton keeps a dead stub's series).
        self.drain_timeout_s = min(self.drain_timeout_s, answer_within_s)
        self.finalize()
        log.error("%s: a rank of the engine died; exiting so that the watchdog restarts this "
                  "instance", self.name)
        logging.shutdown()
        os._exit(70)

    def finalize(self) -> None:
        # Let sequences in flight finish first: an instance is finalized when the server stops
        # and when a resize removes it (the autoscaler), and Triton 2.51 does not wait for a
        # decoupled instance's open requests (it crashed finalizing one mid-stream).
        deadline = time.monotonic() + self.drain_timeout_s
        while self._callers and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._callers:
            log.warning("%d sequences still running after %.0f s; failing them",
                        len(self._callers), self.drain_timeout_s)
        self.loop.stop()
        for seq_id in list(self._callers):
            self.on_finished_early(seq_id, ShuttingDown("server shutting down"))
        self.outbox.close()
        self.metrics.retire()
        for sink in self._sinks.values():
            sink.close()
        self._boards.close()


class DecodeModel(GeneratorModel):
    """decode: a generator whose requests mostly arrive prefilled elsewhere, so its KV
    transports are on by default."""

    OPTIONS = DecodeOptions
