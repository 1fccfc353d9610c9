"""`prefill`: a prefill instance (decoupled, Triton dynamic batching). Each prompt joins the
instance's continuous batch; its response (first token and a KV handle naming its leased blocks)
goes out as soon as that prompt is done (see engine.prefiller)."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
import triton_python_backend_utils as pb_utils

from python_backends.diagnostics import set_up_process
from python_backends.engine.engine_loop import build_off_thread
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.prefiller import Prefiller, PrefillJob, PrefillResult
from python_backends.flag_board import BoardCache, FlagBoard
from python_backends.kv_transfer.base import abandon
from python_backends.kv_transfer.factory import TransportUnavailable, make_sources
from python_backends.kv_transfer.host_shm import SharedPool
from python_backends.kv_transfer.layout import KVLayout, allocate_pool
from python_backends.serving.common import (
    FINAL,
    ModelArgs,
    engine_calls,
    engine_path,
    error_response,
    kv_transports,
    response,
)
from python_backends.serving.engine_options import prefix_caching
from python_backends.serving.metrics import EngineMetrics, KVTransferMetrics
from python_backends.serving.options import PrefillOptions
from python_backends.serving.outbox import Outbox, caller_gone, caller_lane
from python_backends.wire import PrefillReply

log = logging.getLogger(__name__)


def prefill_response(result: PrefillResult) -> Any:
    return response(PrefillReply(
        token_id=result.token_id,
        log_prob=result.logprob,
        finish_reason=result.finish_reason.value if result.finish_reason else "",
        kv_handle=result.handle.to_json().encode() if result.handle else b"",
        top_ids=[t for t, _ in result.event.top] if result.event else [],
        top_log_probs=[lp for _, lp in result.event.top] if result.event else [],
    ), batched=True)


class PrefillModel:
    def initialize(self, args: dict[str, str]) -> None:
        margs = ModelArgs(args)
        set_up_process(margs.instance_name)
        options = margs.options(PrefillOptions)
        transports = kv_transports(margs, options.kv_transports)
        self._shared: SharedPool | None = None

        def pool(layout: KVLayout, device: torch.device) -> torch.Tensor:
            if "host_shm" not in transports or device.type != "cpu":
                return allocate_pool(layout, device=device)  # host_shm refuses a GPU pool
            self._shared = SharedPool.create(layout)
            return self._shared.tensor

        engine = build_off_thread(partial(
            LLMEngine.from_engine_dir,
            engine_path(options.engine_dir), num_kv_blocks=options.kv_cache_blocks,
            kv_pool=pool, placement=margs.placement, cpu_threads=options.threads,
            step_tokens=options.max_num_batched_tokens,
            **prefix_caching(options),
        ))
        try:
            sources = make_sources(transports, engine.handoff.pool, margs.model_name,
                                   self._shared.name if self._shared else None)
        except TransportUnavailable as e:
            raise pb_utils.TritonModelException(f"{margs.model_name}: {e}") from None
        self.metrics = EngineMetrics(margs.model_name, margs.instance_name)
        self.kv_metrics = KVTransferMetrics(margs.model_name, margs.instance_name)
        self.outbox = Outbox(margs.instance_name)
        self._boards = BoardCache()  # the fronts' cancel boards
        self.prefiller = Prefiller(
            engine, sources, owner=margs.instance_name,
            lease_s=options.kv_lease_seconds,
            on_reaped=self._on_reaped, on_step=self.metrics.publish_throttled,
        )
        self.metrics.publish(engine.stats())
        self.prefiller.start()
        log.info("%s: KV transports %s", margs.instance_name, ", ".join(sources))

    def _on_reaped(self, num_expired: int) -> None:
        if num_expired:
            self.kv_metrics.expired_leases.increment(num_expired)

    def execute(self, requests: list[Any]) -> None:
        for call in engine_calls(requests, self._boards, self.outbox, "prefill"):
            req = call.message.request
            job = PrefillJob(req.prompt_ids, req.params, req.kv_transport, req.kv_fault,
                             req.priority, req.tenant, req.cache_salt,
                             call.is_cancelled)
            self.prefiller.submit(job, partial(self._done, call.sender, call.board))
        return None

    def _done(
        self, sender: Any, board: FlagBoard | None, result: PrefillResult | Exception
    ) -> None:
        """On the engine loop thread: queue the response, never block the loop."""
        if caller_gone(self.outbox, board):  # its front died: nobody takes the answer
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
        self.prefiller.close()
        self.outbox.close()
        self.metrics.retire()
        self._boards.close()
        if self._shared is not None:
            self._shared.close()
