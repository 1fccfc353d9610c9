"""Helpers shared by the models: tensors, errors, parameters, engine location."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.cancel_board import BoardCache, CancelBoard
from python_backends.config import DEFAULT_ENGINE_DIR, ENGINE_DIR_ENV

if TYPE_CHECKING:
    from python_backends.engine.placement import Placement


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
        from python_backends.engine.placement import Placement

        return Placement.from_triton_args(self._args)

    def param(self, key: str, default: str = "") -> str:
        value = self.config.get("parameters", {}).get(key, {}).get("string_value", "")
        return value or default

    def int_param(self, key: str, default: int) -> int:
        value = self.param(key)
        try:
            return int(value) if value else default
        except ValueError:
            raise pb_utils.TritonModelException(
                f"{self.model_name}: parameter {key} must be an integer, got {value!r}"
            ) from None

    def engine_dir(self) -> Path:
        """Engine directory: the model's `engine_dir` parameter, else $LLM_ENGINE_DIR, else the
        default engine that scripts/serve.sh builds."""
        return Path(
            self.param("engine_dir") or os.environ.get(ENGINE_DIR_ENV) or DEFAULT_ENGINE_DIR
        )


# `kv_transports: auto`: what the instance's KV pool allows, fastest first.
AUTO_TRANSPORTS = {False: "nixl,host_shm", True: "cuda_ipc,nixl"}  # by "on a GPU"


def kv_transports(margs: ModelArgs, default: str = "") -> list[str]:
    """The model's `kv_transports` parameter: comma-separated, in order of preference, or
    `auto` (AUTO_TRANSPORTS by the instance's kind). NIXL is left out, with a warning, where
    nixl-cu12 is not installed."""
    from python_backends.kv_transfer import nixl
    from python_backends.kv_transfer.factory import TransportUnavailable, check_names

    value = margs.param("kv_transports", default)
    if value.strip() == "auto":
        value = AUTO_TRANSPORTS[margs.placement.on_gpu]
    names = [n.strip() for n in value.split(",") if n.strip()]
    try:
        check_names(names)
    except TransportUnavailable as e:
        raise pb_utils.TritonModelException(f"{margs.model_name}: kv_transports: {e}") from None
    if "nixl" in names and not nixl.available():
        logging.getLogger(__name__).warning(
            "%s: nixl-cu12 is not installed; NIXL transport off", margs.model_name
        )
        names.remove("nixl")
    return names


def inputs_of(request: Any) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def first(inputs: dict[str, np.ndarray], name: str) -> Any:
    """The single value of a one-element input (whatever its batch shape)."""
    return inputs[name].reshape(-1)[0]


def first_bytes(inputs: dict[str, np.ndarray], name: str) -> bytes:
    return bytes(first(inputs, name))


def cancel_target(inputs: dict[str, np.ndarray], boards: BoardCache) -> tuple[CancelBoard, int]:
    """The cancel board and ticket the scheduler attached to a request (see cancel_board)."""
    board = boards.get(first_bytes(inputs, "CANCEL_BOARD").decode())
    return board, int(first(inputs, "CANCEL_TICKET"))


def tensor(name: str, array: np.ndarray) -> Any:
    return pb_utils.Tensor(name, array)


def bytes_tensor(name: str, values: list[str | bytes], batch: bool = True) -> Any:
    arr = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
    return pb_utils.Tensor(name, arr[None, :] if batch else arr)


def error_response(message: str, code: Any = None) -> Any:
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class ShuttingDown(RuntimeError):
    pass
