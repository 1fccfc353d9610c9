"""`prefill`: a prefill instance (decoupled, Triton dynamic batching). Each prompt joins the
instance's continuous batch; its response (first token and a KV handle naming its leased blocks)
goes out as soon as that prompt is done (see engine.prefill_server)."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from python_backends.cancel_board import BoardCache, CancelBoard
from python_backends.diagnostics import enable_stack_dumps
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.prefill_server import PrefillJob, PrefillResult, PrefillServer
from python_backends.kv_transfer.base import abandon
from python_backends.kv_transfer.factory import TransportUnavailable, make_sources
from python_backends.kv_transfer.host_shm import SharedPool
from python_backends.kv_transfer.layout import KVLayout, allocate_pool
from python_backends.protocol import GenerationRequest
from python_backends.serving.common import (
    FINAL,
    ModelArgs,
    bytes_tensor,
    cancel_target,
    error_response,
    first_bytes,
    inputs_of,
    kv_transports,
    tensor,
)
from python_backends.serving.metrics import EngineMetrics, KVTransferMetrics
from python_backends.serving.outbox import Outbox, caller_gone, caller_lane

log = logging.getLogger(__name__)


def _cancelled(board: CancelBoard | None, ticket: int) -> bool:
    """The client cancelled, or the scheduler that asked is gone (False for direct callers)."""
    return board is not None and board.is_cancelled(ticket)


def prefill_response(result: PrefillResult) -> Any:
    return pb_utils.InferenceResponse([
        tensor("OUTPUT_IDS", np.array([[result.token_id]], dtype=np.int32)),
        tensor("OUTPUT_LOG_PROBS", np.array([[result.logprob]], dtype=np.float32)),
        bytes_tensor("FINISH_REASON", [result.finish_reason.value if result.finish_reason
                                       else ""]),
        bytes_tensor("KV_HANDLE", [result.handle.to_json() if result.handle else ""]),
    ])


class PrefillModel:
    def initialize(self, args: dict[str, str]) -> None:
        enable_stack_dumps()
        margs = ModelArgs(args)
        transports = kv_transports(margs, default="auto")
        self._shared: SharedPool | None = None

        def pool(layout: KVLayout, device: torch.device) -> torch.Tensor:
            if "host_shm" not in transports or device.type != "cpu":
                return allocate_pool(layout, device=device)  # host_shm refuses a GPU pool
            self._shared = SharedPool.create(layout)
            return self._shared.tensor

        engine = LLMEngine.from_engine_dir(
            margs.engine_dir(), num_kv_blocks=margs.int_param("kv_cache_blocks", 512),
            kv_pool=pool, placement=margs.placement,
        )
        try:
            sources = make_sources(transports, engine.kv_pool, margs.model_name,
                                   self._shared.name if self._shared else None)
        except TransportUnavailable as e:
            raise pb_utils.TritonModelException(f"{margs.model_name}: {e}") from None
        self.metrics = EngineMetrics(margs.model_name, margs.instance_name)
        self.kv_metrics = KVTransferMetrics(margs.model_name, margs.instance_name)
        self.outbox = Outbox(margs.instance_name)
        self._boards = BoardCache()  # the schedulers' cancel boards
        self.server = PrefillServer(
            engine, sources, owner=margs.instance_name,
            lease_s=float(margs.param("kv_lease_seconds", "30")),
            on_reaped=self._on_reaped, on_step=self.metrics.publish_throttled,
        )
        self.metrics.publish(engine.stats())
        self.server.start()
        log.info("%s: KV transports %s", margs.instance_name, ", ".join(sources))

    def _on_reaped(self, num_expired: int) -> None:
        if num_expired:
            self.kv_metrics.expired_leases.increment(num_expired)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = inputs_of(request)
                req = GenerationRequest.from_json(first_bytes(inputs, "REQUEST"))
                board, ticket = (cancel_target(inputs, self._boards) if "CANCEL_BOARD" in inputs
                                 else (None, 0))
            except Exception as e:  # malformed internal request: answer it, keep serving
                sender.send(error_response(f"prefill: bad request: {e}"), flags=FINAL)
                continue
            job = PrefillJob(req.prompt_ids, req.params, req.kv_transport, req.kv_fault,
                             req.priority, req.tenant, partial(_cancelled, board, ticket))
            self.server.submit(job, partial(self._done, sender, board))
        return None

    def _done(
        self, sender: Any, board: CancelBoard | None, result: PrefillResult | Exception
    ) -> None:
        """On the engine loop thread: queue the response, never block the loop."""
        if caller_gone(self.outbox, board):  # its scheduler died: nobody takes the answer
            if isinstance(result, PrefillResult) and result.handle is not None:
                abandon(result.handle, self._boards)  # free the lease now, not at expiry
            return
        lane = caller_lane(board)
        if isinstance(result, Exception):
            self.outbox.put(sender, partial(error_response, f"prefill: {result}"), FINAL, lane)
            return
        if result.event is not None:
            self.metrics.observe(result.event)
        self.outbox.put(sender, partial(prefill_response, result), FINAL, lane)

    def finalize(self) -> None:
        self.server.close()
        self.outbox.close()
        self.metrics.retire()
        self._boards.close()
        if self._shared is not None:
            self._shared.close()
