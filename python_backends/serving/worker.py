"""`worker` and `decode`: a continuous-batching engine instance (decoupled). Requests join the
batch; every step sends each sequence's new token back to the caller (the scheduler, over BLS).

A request may arrive prefilled elsewhere (inputs KV_HANDLE, FIRST_TOKEN, FIRST_LOG_PROB): the
instance pulls its KV through the handle's transport (the `kv_transports` parameter enables
them) and continues from the first token; if the pull fails it recomputes the prompt. The
`decode` group is this model with transports enabled; `worker` usually has none."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.cancel_board import BoardCache, CancelBoard
from python_backends.diagnostics import enable_stack_dumps
from python_backends.engine.engine_loop import EngineLoop
from python_backends.engine.llm_engine import LLMEngine, TokenEvent
from python_backends.engine.waiting_queue import PriorityFairQueue
from python_backends.kv_transfer.base import KVHandle, TransferError, abandon
from python_backends.kv_transfer.factory import TransportUnavailable, make_sinks
from python_backends.protocol import GenerationRequest
from python_backends.serving.common import (
    FINAL,
    ModelArgs,
    ShuttingDown,
    bytes_tensor,
    cancel_target,
    error_response,
    first,
    first_bytes,
    inputs_of,
    kv_transports,
    tensor,
)
from python_backends.serving.metrics import EngineMetrics, KVTransferMetrics
from python_backends.serving.outbox import Outbox, caller_gone, caller_lane

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    sender: Any
    num_prompt_tokens: int
    board: CancelBoard | None  # set when the caller (the scheduler) relays cancellation
    ticket: int

    @property
    def lane(self) -> str:
        """The outbox lane of the caller: its scheduler instance, or direct callers."""
        return caller_lane(self.board)

    def is_cancelled(self) -> bool:
        if self.board is not None:
            return self.board.is_cancelled(self.ticket)
        return bool(self.sender.is_cancelled())


def engine_response(
    token_ids: list[int], logprobs: list[float], finish_reason: str,
    num_input_tokens: int, num_output_tokens: int,
) -> Any:
    return pb_utils.InferenceResponse([
        tensor("OUTPUT_IDS", np.array(token_ids, dtype=np.int32)),
        tensor("OUTPUT_LOG_PROBS", np.array(logprobs, dtype=np.float32)),
        bytes_tensor("FINISH_REASON", [finish_reason], batch=False),
        tensor("NUM_INPUT_TOKENS", np.array([num_input_tokens], dtype=np.int32)),
        tensor("NUM_OUTPUT_TOKENS", np.array([num_output_tokens], dtype=np.int32)),
    ])


class WorkerModel:
    def initialize(self, args: dict[str, str]) -> None:
        enable_stack_dumps()
        margs = ModelArgs(args)
        try:
            weights = {k: float(v) for k, v in json.loads(margs.param("tenant_weights", "{}"))
                       .items()}
        except (ValueError, AttributeError) as e:
            raise pb_utils.TritonModelException(f"worker: bad tenant_weights: {e}") from None
        engine = LLMEngine.from_engine_dir(
            margs.engine_dir(),
            num_kv_blocks=margs.int_param("kv_cache_blocks", 1024),
            enable_chunked_prefill=margs.param("enable_chunked_prefill", "true") == "true",
            waiting=PriorityFairQueue(weights),
            placement=margs.placement,
        )
        self.metrics = EngineMetrics(margs.model_name, margs.instance_name)
        self._pending: dict[str, _Pending] = {}
        self._boards = BoardCache()
        transports = kv_transports(margs)
        self.kv_metrics = KVTransferMetrics(margs.model_name, margs.instance_name, transports)
        try:
            self._sinks = make_sinks(transports, engine.kv_layout, engine.kv_pool,
                                     margs.model_name, self._boards)
        except TransportUnavailable as e:
            raise pb_utils.TritonModelException(f"{margs.model_name}: {e}") from None
        self.drain_timeout_s = float(margs.param("drain_timeout_seconds", "60"))
        self.outbox = Outbox(margs.instance_name)
        self.loop = EngineLoop(
            engine,
            on_tokens=self._on_tokens,
            on_finished_early=self._on_finished_early,
            is_cancelled=lambda seq_id: self._pending[seq_id].is_cancelled(),
            on_step=self.metrics.publish_throttled,
        )
        engine.after_handoffs = self._flush_releases
        self.metrics.publish(engine.stats())
        self.loop.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = inputs_of(request)
                req = GenerationRequest.from_json(first_bytes(inputs, "REQUEST"))
                board: CancelBoard | None = None
                ticket = 0
                if "CANCEL_BOARD" in inputs:
                    board, ticket = cancel_target(inputs, self._boards)
                handle_json = first_bytes(inputs, "KV_HANDLE") if "KV_HANDLE" in inputs else b""
                handoff = None
                if handle_json:
                    handoff = (KVHandle.from_json(handle_json), int(first(inputs, "FIRST_TOKEN")),
                               float(first(inputs, "FIRST_LOG_PROB")))
            except Exception as e:  # malformed internal request: answer it, keep serving
                sender.send(error_response(f"worker: bad request: {e}"), flags=FINAL)
                continue
            seq_id = uuid.uuid4().hex
            self._pending[seq_id] = _Pending(sender, len(req.prompt_ids), board, ticket)
            if handoff is not None:
                handle, first_token, first_logprob = handoff
                self.loop.submit_handoff(
                    seq_id, req.prompt_ids, req.params, first_token, first_logprob,
                    handle.num_tokens, partial(self._fetch, handle), req.priority, req.tenant,
                )
            else:
                self.loop.submit(seq_id, req.prompt_ids, req.params, req.priority, req.tenant)
        return None

    def _fetch(self, handle: KVHandle, blocks: list[int]) -> bool:
        """Pull a handed-off request's KV into `blocks` (engine-loop thread). False: recompute."""
        sink = self._sinks.get(handle.transport)
        reason = ""
        if sink is None:
            reason = "unsupported"
            log.warning("KV handle over %s, which this instance does not enable; recomputing",
                        handle.transport)
        else:
            start = time.perf_counter()
            try:
                nbytes = sink.fetch(handle, blocks)
                self.kv_metrics.transferred(handle.transport, nbytes, time.perf_counter() - start)
                return True
            except TransferError as e:
                reason = e.kind.value
                log.warning("KV pull from %s failed (%s); recomputing", handle.owner, e)
            except Exception:
                reason = "error"
                log.exception("KV pull from %s failed; recomputing", handle.owner)
        abandon(handle, self._boards)
        self.kv_metrics.failed(handle.transport, reason)
        return False

    def _flush_releases(self) -> None:
        for sink in self._sinks.values():
            try:
                sink.flush()
            except Exception:  # the owner reaps the leases when they expire
                log.exception("sending KV lease releases failed")

    def _on_tokens(self, events: list[TokenEvent]) -> None:
        for ev in events:
            self.metrics.observe(ev)
            if ev.finish_reason is None:
                pending, flags = self._pending[ev.seq_id], 0
            else:
                pending, flags = self._pending.pop(ev.seq_id), FINAL
            self.outbox.put(pending.sender, partial(
                engine_response, [ev.token_id], [ev.logprob or 0.0],
                ev.finish_reason.value if ev.finish_reason else "",
                ev.num_prompt_tokens, ev.num_output_tokens,
            ), flags, pending.lane)

    def _on_finished_early(self, seq_id: str, error: Exception | None) -> None:
        pending = self._pending.pop(seq_id)
        if caller_gone(self.outbox, pending.board):  # its scheduler died: nobody to answer
            return
        if error is not None:
            code = (pb_utils.TritonError.INVALID_ARG if isinstance(error, ValueError)
                    else pb_utils.TritonError.UNAVAILABLE if isinstance(error, ShuttingDown)
                    else pb_utils.TritonError.INTERNAL)
            self.outbox.put(pending.sender, partial(error_response, str(error), code), FINAL,
                            pending.lane)
        else:
            self.outbox.put(pending.sender, partial(
                engine_response, [], [], "cancelled", pending.num_prompt_tokens, 0
            ), FINAL, pending.lane)

    def finalize(self) -> None:
        # Let sequences in flight finish first: an instance is finalized when the server stops
        # and when a resize removes it (the autoscaler), and Triton 2.51 does not wait for a
        # decoupled instance's open requests (it crashed finalizing one mid-stream).
        deadline = time.monotonic() + self.drain_timeout_s
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._pending:
            log.warning("%d sequences still running after %.0f s; failing them",
                        len(self._pending), self.drain_timeout_s)
        self.loop.stop()
        for seq_id in list(self._pending):
            self._on_finished_early(seq_id, ShuttingDown("server shutting down"))
        self.outbox.close()
        self.metrics.retire()
        for sink in self._sinks.values():
            sink.close()
        self._boards.close()
