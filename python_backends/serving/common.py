"""Helpers shared by the models: tensors, errors, parameters, engine location."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.config import engine_dir_default
from python_backends.flag_board import BoardCache, FlagBoard
from python_backends.serving.options import OptionError, Options
from python_backends.serving.options import parse as parse_options
from python_backends.serving.outbox import Outbox, caller_lane
from python_backends.wire import EngineRequest, Message

if TYPE_CHECKING:
    from python_backends.parallel.placement import Placement


class ModelArgs:
    """The `args` Triton passes to `initialize`, with typed access to config parameters."""

    def __init__(self, args: dict[str, str]) -> None:
        self.model_name = args["model_name"]
        self.instance_name = args.get("model_instance_name", self.model_name)
        self.config: dict[str, Any] = json.loads(args["model_config"])
        self._args = args

    @property
    def placement(self) -> Placement:
        """Where Triton put this instance (imported here: front-end models need no torch)."""
        from python_backends.parallel.placement import Placement

        return Placement.from_triton_args(self._args)

    def options(self, cls: type[Options]) -> Options:
        """The model's parameters as `cls` (serving.options), checked once; a bad one stops
        the load with its name."""
        params = {key: value.get("string_value", "")
                  for key, value in self.config.get("parameters", {}).items()}
        try:
            return parse_options(cls, params)
        except OptionError as e:
            raise pb_utils.TritonModelException(f"{self.model_name}: {e}") from None


def engine_path(engine_dir: str) -> Path:
    """An `engine_dir` parameter's directory: itself, or when empty $LLM_ENGINE_DIR, else the
    default engine that scripts/serve.sh builds."""
    return Path(engine_dir) if engine_dir else engine_dir_default()


# `kv_transports: auto`: what the instance's KV pool allows, fastest first.
AUTO_TRANSPORTS = {False: "nixl,host_shm", True: "cuda_ipc,nixl"}  # by "on a GPU"


def kv_transports(margs: ModelArgs, value: str) -> list[str]:
    """The model's `kv_transports` parameter: comma-separated, in order of preference, or
    `auto` (AUTO_TRANSPORTS by the instance's kind, NIXL on a GPU only where its build matches
    torch's CUDA: kv_transfer.nixl.vram_problem). NIXL is left out, with a warning, where it is
    not installed or `auto` leaves it out."""
    from python_backends.kv_transfer import nixl
    from python_backends.kv_transfer.factory import TransportUnavailable, check_names

    names = [n.strip() for n in value.split(",") if n.strip()]
    on_gpu = margs.placement.on_gpu
    if value.strip() == "auto":
        names = AUTO_TRANSPORTS[on_gpu].split(",")
        if on_gpu and "nixl" in names and (why := nixl.vram_problem()) is not None:
            logging.getLogger(__name__).warning(
                "%s: kv_transports auto: NIXL not offered from GPU memory: %s",
                margs.model_name, why)
            names.remove("nixl")
    try:
        check_names(names)
    except TransportUnavailable as e:
        raise pb_utils.TritonModelException(f"{margs.model_name}: kv_transports: {e}") from None
    if "nixl" in names and not nixl.available():
        logging.getLogger(__name__).warning(
            "%s: NIXL (nixl-cu12 or nixl-cu13) is not installed; NIXL transport off",
            margs.model_name)
        names.remove("nixl")
    return names


def inputs_of(request: Any) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def outputs_of(response: Any) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in response.output_tensors()}


def tensors(message: Message, batched: bool) -> list[Any]:
    """`message` as Triton tensors; `batched`: for a model with a max_batch_size."""
    return [pb_utils.Tensor(name, arr) for name, arr in message.encode(batched).items()]


def response(message: Message, batched: bool) -> Any:
    return pb_utils.InferenceResponse(tensors(message, batched))


def bls_request(model: str, message: Message, batched: bool, reply_type: type[Message]) -> Any:
    """A BLS request of `message` to `model`, asking for the tensors of `reply_type`."""
    return pb_utils.InferenceRequest(model_name=model, inputs=tensors(message, batched),
                                     requested_output_names=reply_type.names())


@dataclass(frozen=True)
class EngineCall:
    """An EngineRequest as an engine model received it: whom to answer, and the front's cancel
    board and ticket (None for a direct caller, which attaches none; see flag_board)."""

    sender: Any
    message: EngineRequest
    board: FlagBoard | None
    ticket: int

    @property
    def lane(self) -> str:
        """The outbox lane of the caller: its front instance, or direct callers."""
        return caller_lane(self.board)

    def is_cancelled(self) -> bool:
        """The client cancelled, or the front that asked is gone; a caller without a board (a
        front on another server, a direct client) cancels its Triton request instead."""
        if self.board is not None:
            return self.board.is_cancelled(self.ticket)
        return bool(self.sender.is_cancelled())


def engine_calls(requests: list[Any], boards: BoardCache, outbox: Outbox, model: str
                 ) -> Iterator[EngineCall]:
    """Decode each request of an engine model's `execute`, recording this process as its holder
    on the front's board, and accept it at once with an empty response (see `accepted`); a
    malformed one (a bug in its caller) is answered with an error and skipped. Both go out on
    the caller's outbox lane, as every later response of the call does: a send to a caller
    that died never returns, and must not stall `execute`."""
    for request in requests:
        sender = request.get_response_sender()
        try:
            msg = EngineRequest.decode(inputs_of(request))
            board = boards.get(msg.cancel_board) if msg.cancel_board else None
        except Exception as e:
            outbox.put(sender, partial(error_response, f"{model}: bad request: {e}"), FINAL)
            continue
        if board is not None:  # the front watches this process while it holds the request
            board.hold(msg.cancel_ticket, os.getpid())
        call = EngineCall(sender, msg, board, msg.cancel_ticket if board else 0)
        outbox.put(sender, accepted, 0, call.lane)
        yield call


def accepted() -> Any:
    """An engine's first response to every call it takes: no tensors, not final. Triton 2.51's
    Python backend holds a thread of the caller's instance pool per decoupled BLS call until
    its first response, so answering at once keeps a queued request from holding one
    (docs/platform.md). Callers skip it: it carries nothing."""
    return pb_utils.InferenceResponse(output_tensors=[])


def error_response(message: str, code: Any = None) -> Any:
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class ShuttingDown(RuntimeError):
    pass
