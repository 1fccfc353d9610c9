"""`front`: the decoupled BLS front of every request.

It routes each tokenized request (see front.routing): to the aggregated `worker` group, or
to the `prefill` group (first token and KV handle; the token is sent at once) and then the
`decode` group with the handle. It turns the engine's per-step responses into client chunks
(one per token when streaming, one in all otherwise) and watches for client cancellation, which
it relays to the engine through the cancel board (and to a prefill lease, which it abandons).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import triton_python_backend_utils as pb_utils

from python_backends.diagnostics import enable_stack_dumps
from python_backends.flag_board import BoardCache, BoardFull, FlagBoard
from python_backends.front.admission import (
    AdmissionControl,
    AdmissionLimits,
    RateLimiter,
    Rejected,
    RejectReason,
    parse_rate_limits,
)
from python_backends.front.routing import Route, Router, RoutingPolicy
from python_backends.front.stream import RequestStream
from python_backends.front.tenancy import CacheSharing
from python_backends.front.validation import InvalidRequest
from python_backends.kv_transfer.base import KVHandle, abandon
from python_backends.serving.bls import BLSStreams
from python_backends.serving.common import (
    FINAL,
    ModelArgs,
    bls_request,
    error_response,
    inputs_of,
    outputs_of,
    response,
)
from python_backends.serving.metrics import AdmissionMetrics, RequestMetrics
from python_backends.wire import (
    EngineRequest,
    ErrorKind,
    GenerationRequest,
    PrefillAnswer,
    TokenizedRequest,
    TokenStep,
)

log = logging.getLogger(__name__)


def error_code(kind: str) -> Any:
    """The Triton error code for an engine error of this ErrorKind (looked up at call time: the
    stub's pb_utils has no TritonError while it imports the model)."""
    return {
        ErrorKind.INVALID: pb_utils.TritonError.INVALID_ARG,
        ErrorKind.UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE,
        ErrorKind.INTERNAL: pb_utils.TritonError.INTERNAL,
    }[ErrorKind(kind)]


class ClientLink:
    """One request's link to its client: response sender, cancel ticket, admission wait."""

    def __init__(
        self, sender: Any, board: FlagBoard, ticket: int, leave: Callable[[], None]
    ) -> None:
        self.sender = sender
        self.board = board
        self.ticket = ticket
        self.cancelled = False
        self.failed = False  # answered with an error (its final response)
        self._leave: Callable[[], None] | None = leave

    def first_response(self) -> None:
        """The request stops waiting (counted by admission control) at its first response."""
        if self._leave is not None:
            self._leave()
            self._leave = None

    def check_cancelled(self) -> bool:
        # Postprocessing raises the flag when the client cancels a stream (see flag_board);
        # a direct caller of this model cancels the sender itself. Engines see the flag.
        if not self.cancelled and (self.board.is_cancelled(self.ticket)
                                   or self.sender.is_cancelled()):
            self.cancelled = True
            self.board.cancel(self.ticket)
        return self.cancelled

    def fail(self, message: str, code: Any) -> None:
        self.sender.send(error_response(message, code), flags=FINAL)
        self.failed = self.cancelled = True  # nothing more goes to this client


class FrontModel:
    def initialize(self, args: dict[str, str]) -> None:
        enable_stack_dumps()
        margs = ModelArgs(args)
        self.worker_model = margs.param("worker_model", "worker")
        self.prefill_model = margs.param("prefill_model")
        self.decode_model = margs.param("decode_model")
        if bool(self.prefill_model) != bool(self.decode_model):
            raise pb_utils.TritonModelException(
                "front: set both prefill_model and decode_model, or neither"
            )
        self.router = Router(RoutingPolicy(
            disaggregation=bool(self.prefill_model),
            aggregation=bool(self.worker_model),
            min_prompt_tokens=margs.int_param("disaggregation_min_prompt_tokens", 256),
            max_inflight_prefills=margs.int_param("disaggregation_max_inflight_prefills", 8),
        ))
        self._boards = BoardCache()  # prefill instances' release boards
        self.bls = BLSStreams()  # every BLS call goes through it (see serving.bls)
        self.board = FlagBoard.create()
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
            raise pb_utils.TritonModelException(f"front: bad rate_limits: {e}") from None
        self.rate_limiter = RateLimiter(limits)
        self.cache_sharing = CacheSharing.parse(margs.param("prefix_cache_shared_tenants"))
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
                req = TokenizedRequest.decode(inputs_of(request)).request
            except Exception as e:
                sender.send(error_response(f"front: bad request: {e}",
                                           pb_utils.TritonError.INVALID_ARG), flags=FINAL)
                continue
            self.pool.submit(self._serve, sender, req)
        return None

    def _serve(self, sender: Any, req: GenerationRequest) -> None:
        try:
            self._serve_one(sender, req)
        except Exception as e:
            log.exception("request failed")
            sender.send(error_response(f"front: {e}", pb_utils.TritonError.INTERNAL),
                        flags=FINAL)

    def _serve_one(self, sender: Any, req: GenerationRequest) -> None:
        req = dataclasses.replace(req, cache_salt=self.cache_sharing.salt(req.tenant,
                                                                          req.cache_salt))
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
        call = ClientLink(sender, self.board, ticket, lambda: self.admission.leave(prompt_tokens))
        state = RequestStream(req.prompt_ids, req.stream, req.exclude_input_in_output,
                              req.params.return_log_probs, self.board.name, ticket)
        try:
            self._route(req, state, call)
        finally:
            self.board.release(ticket)
            call.first_response()
        if call.failed:
            return  # the error was the final response
        if call.cancelled or not state.finish_reason:
            sender.send(flags=FINAL)  # the client went away or the engine ended without a chunk
            return
        self.metrics.finished(state)

    def _route(self, req: GenerationRequest, state: RequestStream, call: ClientLink) -> None:
        try:
            route = self.router.choose(req.route, len(req.prompt_ids))
        except InvalidRequest as e:
            call.fail(str(e), pb_utils.TritonError.INVALID_ARG)
            return
        engine_request = EngineRequest(req, self.board.name, call.ticket)
        if route is Route.AGGREGATED:
            self.metrics.routed(route.value)
            self._relay(self.worker_model, engine_request, state, call)
            return
        try:
            prefilled = self._prefill(engine_request)
        finally:
            self.router.prefill_done()
        if prefilled is None and call.check_cancelled():
            return  # the prefill was dropped because the client went away
        if prefilled is None:  # the prefill group failed: decode computes the prompt itself
            self.metrics.routed("disaggregated_fallback")
            self._relay(self.decode_model, engine_request, state, call)
            return
        self.metrics.routed(route.value)
        call.first_response()
        chunk = state.add([prefilled.token_id], [prefilled.log_prob], prefilled.finish_reason)
        if chunk is not None:
            call.sender.send(response(chunk, batched=True),
                             flags=FINAL if prefilled.finish_reason else 0)
        if prefilled.finish_reason:
            return
        if call.check_cancelled():  # the decode step never comes: free the lease now
            abandon(KVHandle.from_json(prefilled.kv_handle), self._boards)
            return
        self._relay(self.decode_model, dataclasses.replace(
            engine_request, kv_handle=prefilled.kv_handle, first_token=prefilled.token_id,
            first_log_prob=prefilled.log_prob,
        ), state, call)

    def _prefill(self, engine_request: EngineRequest) -> PrefillAnswer | None:
        """The prefill group's answer; None when it failed (logged)."""
        request = bls_request(self.prefill_model, engine_request, True, PrefillAnswer)
        result = None
        for answer in self.bls.stream(request):  # one answer, then the final flag
            if answer.has_error():
                log.warning("prefill failed, decode will recompute: %s",
                            answer.error().message())
            elif answer.output_tensors():
                result = PrefillAnswer.decode(outputs_of(answer))
        return result

    def _relay(self, model: str, engine_request: EngineRequest, state: RequestStream,
               call: ClientLink) -> None:
        """Stream an engine model's responses to the client as chunks."""
        request = bls_request(model, engine_request, False, TokenStep)
        for answer in self.bls.stream(request):
            call.first_response()  # a token, an error or the end ends the wait
            if answer.has_error():  # keeps the engine's code: a refusal is the client's
                error = answer.error()
                call.fail(error.message(), error.code())
                return
            if call.check_cancelled() or not answer.output_tensors():
                continue  # drain until the engine's final response
            step = TokenStep.decode(outputs_of(answer))
            if step.error:  # keeps the engine's kind: a refusal is the client's mistake
                call.fail(step.error, error_code(step.error_kind))
                continue  # drain until the engine's final response
            chunk = state.add(step.output_ids, step.output_log_probs, step.finish_reason)
            if chunk is not None:
                flags = FINAL if chunk.finish_reason else 0
                call.sender.send(response(chunk, batched=True), flags=flags)

    def finalize(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.bls.close()
        self.board.close()
        self._boards.close()
