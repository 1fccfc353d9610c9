"""`scheduler`: the decoupled BLS front of every request.

It forwards the tokenized request to an engine model, turns the engine's per-step responses
into client chunks (one per token when streaming, one in all otherwise) and watches for client
cancellation, which it relays to the engine through the cancel board.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.cancel_board import BoardFull, CancelBoard
from python_backends.protocol import GenerationRequest
from python_backends.scheduler.admission import (
    AdmissionControl,
    AdmissionLimits,
    RateLimiter,
    Rejected,
    parse_rate_limits,
)
from python_backends.scheduler.stream import Chunk, RequestStream
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


class SchedulerModel:
    def initialize(self, args: dict[str, str]) -> None:
        margs = ModelArgs(args)
        self.worker_model = margs.param("worker_model", "worker")
        self.board = CancelBoard.create()
        self.metrics = RequestMetrics(margs.model_name)
        self.admission_metrics = AdmissionMetrics(margs.model_name)
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
        for request in requests:
            self.pool.submit(self._serve, request)
        return None

    def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            self._serve_one(request, sender)
        except Exception as e:
            log.exception("request failed")
            sender.send(error_response(f"scheduler: {e}", pb_utils.TritonError.INTERNAL),
                        flags=FINAL)

    def _serve_one(self, request: Any, sender: Any) -> None:
        inputs = inputs_of(request)
        request_json = first_bytes(inputs, "REQUEST")
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
        waiting = True
        try:
            ticket = self.board.acquire()
        except BoardFull as e:
            self.admission.leave(prompt_tokens)
            sender.send(error_response(f"server overloaded: {e}",
                                       pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
            return
        engine_inputs = [
            tensor("INPUT_IDS", np.array(req.prompt_ids, dtype=np.int32)),
            bytes_tensor("REQUEST", [request_json], batch=False),
            bytes_tensor("CANCEL_BOARD", [self.board.name], batch=False),
            tensor("CANCEL_TICKET", np.array([ticket], dtype=np.int32)),
        ]
        cancelled = False
        try:
            bls = pb_utils.InferenceRequest(
                model_name=self.worker_model,
                inputs=engine_inputs,
                requested_output_names=ENGINE_OUTPUTS,
            )
            for response in bls.exec(decoupled=True):
                if waiting:  # the first response (a token, an error or the end) ends the wait
                    waiting = False
                    self.admission.leave(prompt_tokens)
                if response.has_error():  # keeps the engine's code: a refusal is the client's
                    error = response.error()
                    sender.send(error_response(error.message(), error.code()), flags=FINAL)
                    return
                # Postprocessing raises the flag when the client cancels a stream (see
                # cancel_board); a direct caller of this model cancels the sender itself.
                if not cancelled and (self.board.is_cancelled(ticket) or sender.is_cancelled()):
                    cancelled = True
                    self.board.cancel(ticket)
                if cancelled or not response.output_tensors():
                    continue  # drain until the engine's final response
                chunk = state.add(
                    _output(response, "OUTPUT_IDS").tolist(),
                    _output(response, "OUTPUT_LOG_PROBS").tolist(),
                    bytes(_output(response, "FINISH_REASON")[0]).decode(),
                )
                if chunk is not None:
                    flags = FINAL if chunk.finish_reason else 0
                    sender.send(chunk_response(chunk, self.board.name, ticket), flags=flags)
        finally:
            self.board.release(ticket)
            if waiting:
                self.admission.leave(prompt_tokens)
        if cancelled or not state.finish_reason:
            sender.send(flags=FINAL)  # the client went away or the engine ended without a chunk
            return
        if state.ttft is not None:
            self.metrics.ttft.observe(state.ttft)
        if state.tpot is not None:
            self.metrics.tpot.observe(state.tpot)

    def finalize(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.board.close()
