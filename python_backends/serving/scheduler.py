"""`scheduler`: the decoupled BLS front of every request.

It routes each tokenized request (see scheduler.routing): to the aggregated `worker` group, or
to the `prefill` group (first token and KV handle; the token is sent at once) and then the
`decode` group with the handle. It turns the engine's per-step responses into client chunks
(one per token when streaming, one in all otherwise) and watches for client cancellation, which
it relays to the engine through the cancel board (and to a prefill lease, which it abandons).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.cancel_board import BoardCache, BoardFull, CancelBoard
from python_backends.diagnostics import enable_stack_dumps
from python_backends.kv_transfer.base import KVHandle, abandon
from python_backends.protocol import GenerationRequest, InvalidRequest
from python_backends.scheduler.admission import (
    AdmissionControl,
    AdmissionLimits,
    RateLimiter,
    Rejected,
    RejectReason,
    parse_rate_limits,
)
from python_backends.scheduler.routing import Route, Router, RoutingPolicy
from python_backends.scheduler.stream import Chunk, RequestStream
from python_backends.serving.bls import BLSStreams
from python_backends.serving.common import (
    FINAL,
    ModelArgs,
    bytes_tensor,
    error_response,
    first_bytes,
    inputs_of,
    tensor,
)
from python_backends.serving.metrics import AdmissionMetrics, RequestMetrics

log = logging.getLogger(__name__)
ENGINE_OUTPUTS = [
    "OUTPUT_IDS", "OUTPUT_LOG_PROBS", "FINISH_REASON", "NUM_INPUT_TOKENS", "NUM_OUTPUT_TOKENS",
]


def chunk_response(chunk: Chunk, board: str, ticket: int) -> Any:
    return pb_utils.InferenceResponse([
        bytes_tensor("CANCEL_BOARD", [board]),
        tensor("CANCEL_TICKET", np.array([[ticket]], dtype=np.int32)),
        tensor("TOKENS", np.array([chunk.tokens], dtype=np.int32)),
        tensor("PREFIX_LEN", np.array([[chunk.prefix_len]], dtype=np.int32)),
        tensor("OUTPUT_IDS", np.array([chunk.output_ids], dtype=np.int32)),
        bytes_tensor("FINISH_REASON", [chunk.finish_reason]),
        tensor("NUM_INPUT_TOKENS", np.array([[chunk.num_input_tokens]], dtype=np.int32)),
        tensor("NUM_OUTPUT_TOKENS", np.array([[chunk.num_output_tokens]], dtype=np.int32)),
        tensor("CUM_LOG_PROBS", np.array([[chunk.cum_log_prob]], dtype=np.float32)),
        tensor("OUTPUT_LOG_PROBS", np.array([chunk.output_log_probs], dtype=np.float32)),
    ])


def _output(response: Any, name: str) -> np.ndarray:
    return pb_utils.get_output_tensor_by_name(response, name).as_numpy()


class _Call:
    """One request's link to its client: response sender, cancel ticket, admission wait."""

    def __init__(
        self, sender: Any, board: CancelBoard, ticket: int, leave: Callable[[], None]
    ) -> None:
        self.sender = sender
        self.board = board
        self.ticket = ticket
        self.cancelled = False
        self._leave: Callable[[], None] | None = leave

    def first_response(self) -> None:
        """The request stops waiting (counted by admission control) at its first response."""
        if self._leave is not None:
            self._leave()
            self._leave = None

    def check_cancelled(self) -> bool:
        # Postprocessing raises the flag when the client cancels a stream (see cancel_board);
        # a direct caller of this model cancels the sender itself. Engines see the flag.
        if not self.cancelled and (self.board.is_cancelled(self.ticket)
                                   or self.sender.is_cancelled()):
            self.cancelled = True
            self.board.cancel(self.ticket)
        return self.cancelled

    def fail(self, message: str, code: Any) -> None:
        self.sender.send(error_response(message, code), flags=FINAL)
        self.cancelled = True  # nothing more goes to this client


class SchedulerModel:
    def initialize(self, args: dict[str, str]) -> None:
        enable_stack_dumps()
        margs = ModelArgs(args)
        self.worker_model = margs.param("worker_model", "worker")
        self.prefill_model = margs.param("prefill_model")
        self.decode_model = margs.param("decode_model")
        if bool(self.prefill_model) != bool(self.decode_model):
            raise pb_utils.TritonModelException(
                "scheduler: set both prefill_model and decode_model, or neither"
            )
        self.router = Router(RoutingPolicy(
            disaggregation=bool(self.prefill_model),
            aggregation=bool(self.worker_model),
            min_prompt_tokens=margs.int_param("disaggregation_min_prompt_tokens", 256),
            max_inflight_prefills=margs.int_param("disaggregation_max_inflight_prefills", 8),
        ))
        self._boards = BoardCache()  # prefill instances' release boards
        self.bls = BLSStreams()  # every BLS call goes through it (see serving.bls)
        self.board = CancelBoard.create()
        self.metrics = RequestMetrics(margs.model_name)
        self.admission_metrics = AdmissionMetrics(
            margs.model_name, tuple(r.value for r in RejectReason)
        )
        self.admission = AdmissionControl(AdmissionLimits(
            max_waiting_requests=margs.int_param("max_waiting_requests", 256),
            max_waiting_tokens=margs.int_param("max_waiting_tokens", 65536),
        ))
        try:
            limits = parse_rate_limits(margs.param("rate_limits"))
        except ValueError as e:
            raise pb_utils.TritonModelException(f"scheduler: bad rate_limits: {e}") from None
        self.rate_limiter = RateLimiter(limits)
        self.pool = ThreadPoolExecutor(
            max_workers=margs.int_param("max_concurrent_requests", 1024),
            thread_name_prefix="request",
        )

    def execute(self, requests: list[Any]) -> None:
        # Requests are read here, while Triton still holds them (their input tensors live in
        # shared memory the server frees once execute returns); the threads get copies.
        for request in requests:
            sender = request.get_response_sender()
            try:
                request_json = first_bytes(inputs_of(request), "REQUEST")
            except Exception as e:
                sender.send(error_response(f"scheduler: bad request: {e}",
                                           pb_utils.TritonError.INVALID_ARG), flags=FINAL)
                continue
            self.pool.submit(self._serve, sender, request_json)
        return None

    def _serve(self, sender: Any, request_json: bytes) -> None:
        try:
            self._serve_one(sender, request_json)
        except Exception as e:
            log.exception("request failed")
            sender.send(error_response(f"scheduler: {e}", pb_utils.TritonError.INTERNAL),
                        flags=FINAL)

    def _serve_one(self, sender: Any, request_json: bytes) -> None:
        req = GenerationRequest.from_json(request_json)
        state = RequestStream(
            req.prompt_ids, req.stream, req.exclude_input_in_output, req.params.return_log_probs
        )
        prompt_tokens = len(req.prompt_ids)
        try:
            self.rate_limiter.check(req.tenant, prompt_tokens + req.params.max_tokens)
            self.admission.enter(prompt_tokens)
        except Rejected as e:
            self.admission_metrics.rejected(e.reason.value, req.tenant)
            sender.send(error_response(str(e), pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
            return
        try:
            ticket = self.board.acquire()
        except BoardFull as e:
            self.admission.leave(prompt_tokens)
            sender.send(error_response(f"server overloaded: {e}",
                                       pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
            return
        call = _Call(sender, self.board, ticket, lambda: self.admission.leave(prompt_tokens))
        try:
            self._route(req, request_json, state, call)
        finally:
            self.board.release(ticket)
            call.first_response()
        if call.cancelled or not state.finish_reason:
            sender.send(flags=FINAL)  # the client went away or the engine ended without a chunk
            return
        self.metrics.finished(state)

    def _route(self, req: GenerationRequest, request_json: bytes, state: RequestStream,
               call: _Call) -> None:
        try:
            route = self.router.choose(req.route, len(req.prompt_ids))
        except InvalidRequest as e:
            call.fail(str(e), pb_utils.TritonError.INVALID_ARG)
            return
        engine_inputs = [
            tensor("INPUT_IDS", np.array(req.prompt_ids, dtype=np.int32)),
            bytes_tensor("REQUEST", [request_json], batch=False),
            bytes_tensor("CANCEL_BOARD", [self.board.name], batch=False),
            tensor("CANCEL_TICKET", np.array([call.ticket], dtype=np.int32)),
        ]
        if route is Route.AGGREGATED:
            self.metrics.routed(route.value)
            self._relay(self.worker_model, engine_inputs, state, call)
            return
        try:
            prefilled = self._prefill(req, request_json, call.ticket)
        finally:
            self.router.prefill_done()
        if prefilled is None and call.check_cancelled():
            return  # the prefill was dropped because the client went away
        if prefilled is None:  # the prefill group failed: decode computes the prompt itself
            self.metrics.routed("disaggregated_fallback")
            self._relay(self.decode_model, engine_inputs, state, call)
            return
        self.metrics.routed(route.value)
        token, logprob, finish_reason, handle_json = prefilled
        call.first_response()
        chunk = state.add([token], [logprob], finish_reason)
        if chunk is not None:
            call.sender.send(chunk_response(chunk, self.board.name, call.ticket),
                             flags=FINAL if finish_reason else 0)
        if finish_reason:
            return
        if call.check_cancelled():  # the decode step never comes: free the lease now
            abandon(KVHandle.from_json(handle_json), self._boards)
            return
        self._relay(self.decode_model, [
            *engine_inputs,
            bytes_tensor("KV_HANDLE", [handle_json], batch=False),
            tensor("FIRST_TOKEN", np.array([token], dtype=np.int32)),
            tensor("FIRST_LOG_PROB", np.array([logprob], dtype=np.float32)),
        ], state, call)

    def _prefill(
        self, req: GenerationRequest, request_json: bytes, ticket: int
    ) -> tuple[int, float, str, bytes] | None:
        """First token, its log-prob, finish reason and KV handle from the prefill group; None
        when it failed (logged)."""
        request = pb_utils.InferenceRequest(
            model_name=self.prefill_model,
            inputs=[
                tensor("INPUT_IDS", np.array([req.prompt_ids], dtype=np.int32)),
                bytes_tensor("REQUEST", [request_json]),
                bytes_tensor("CANCEL_BOARD", [self.board.name]),
                tensor("CANCEL_TICKET", np.array([[ticket]], dtype=np.int32)),
            ],
            requested_output_names=["OUTPUT_IDS", "OUTPUT_LOG_PROBS", "FINISH_REASON",
                                    "KV_HANDLE"],
        )
        result = None
        for response in self.bls.stream(request):  # one answer, then the final flag
            if response.has_error():
                log.warning("prefill failed, decode will recompute: %s",
                            response.error().message())
            elif response.output_tensors():
                result = (
                    int(_output(response, "OUTPUT_IDS").reshape(-1)[0]),
                    float(_output(response, "OUTPUT_LOG_PROBS").reshape(-1)[0]),
                    bytes(_output(response, "FINISH_REASON").reshape(-1)[0]).decode(),
                    bytes(_output(response, "KV_HANDLE").reshape(-1)[0]),
                )
        return result

    def _relay(self, model: str, inputs: list[Any], state: RequestStream, call: _Call) -> None:
        """Stream an engine model's responses to the client as chunks."""
        request = pb_utils.InferenceRequest(
            model_name=model, inputs=inputs, requested_output_names=ENGINE_OUTPUTS,
        )
        for response in self.bls.stream(request):
            call.first_response()  # a token, an error or the end ends the wait
            if response.has_error():  # keeps the engine's code: a refusal is the client's
                error = response.error()
                call.fail(error.message(), error.code())
                return
            if call.check_cancelled() or not response.output_tensors():
                continue  # drain until the engine's final response
            chunk = state.add(
                _output(response, "OUTPUT_IDS").tolist(),
                _output(response, "OUTPUT_LOG_PROBS").tolist(),
                bytes(_output(response, "FINISH_REASON")[0]).decode(),
            )
            if chunk is not None:
                flags = FINAL if chunk.finish_reason else 0
                call.sender.send(chunk_response(chunk, self.board.name, call.ticket),
                                 flags=flags)

    def finalize(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.bls.close()
        self.board.close()
        self._boards.close()
