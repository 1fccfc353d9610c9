"""One request to a Triton server's `ensemble` over gRPC streaming, as an async iterator of
`Piece`s. Closing the iterator early (the client went away, a stop string matched) cancels
the gRPC stream, which ends the request inside the server too (its engine frees the KV).

The OpenAI endpoints always ask the ensemble to stream (its `stream` input): the gateway
shapes non-streaming answers itself, and only a stream lets it stop early.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient

from python_backends.gateway.errors import ApiError, from_triton
from python_backends.wire import CLIENT_INPUTS, FINISH_ERROR, Kind

ENSEMBLE = "ensemble"
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_DTYPES = {Kind.INT: ("INT32", np.int32), Kind.UINT64: ("UINT64", np.uint64),
           Kind.FLOAT: ("FP32", np.float32), Kind.BOOL: ("BOOL", np.bool_)}


@dataclass
class Piece:
    """One response of the ensemble."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0


def ensemble_inputs(values: dict[str, Any]) -> list[grpcclient.InferInput]:
    """The ensemble's input tensors (batch of one) from name -> value, typed by the wire's
    declaration of each input (wire.CLIENT_INPUTS); an unknown name is refused by name."""
    tensors = []
    for name, value in values.items():
        spec = CLIENT_INPUTS.get(name)
        if spec is None:
            raise ApiError(400, f"invalid input '{name}': unknown input", name)
        if spec.kind in (Kind.TEXT, Kind.TEXTS):
            items = value if isinstance(value, list) else [value]
            arr = np.array([[str(v).encode() for v in items]], dtype=np.object_)
            triton_type = "BYTES"
        elif spec.kind is Kind.INTS:
            if not isinstance(value, list) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and INT32_MIN <= v <= INT32_MAX
                    for v in value):
                raise ApiError(400, f"invalid input '{name}': expected a list of INT32 "
                               "integers", name)
            arr = np.array([value], dtype=np.int32)
            triton_type = "INT32"
        else:
            triton_type, np_type = _DTYPES[spec.kind]
            try:
                arr = np.array([[value]], dtype=np_type)
            except (TypeError, ValueError, OverflowError):
                raise ApiError(400, f"invalid input '{name}': expected {triton_type}, got "
                               f"{value!r}", name) from None
        tensor = grpcclient.InferInput(name, list(arr.shape), triton_type)
        tensor.set_data_from_numpy(arr)
        tensors.append(tensor)
    return tensors


class Breaker:
    """The streams open on one server, to end when the gateway learns that the server lost
    them (it stopped answering, or its front restarted: Triton 2.51 never ends the requests a
    dead front stub held, so their streams would stay open and silent). A broken stream raises
    a retryable ApiError, and the gateway moves its request elsewhere."""

    def __init__(self) -> None:
        self._opened: dict[Any, float] = {}  # gRPC call -> when it was opened (Unix time)
        self._heard: dict[Any, float] = {}  # gRPC call -> its last piece (monotonic)
        self._broken: dict[Any, ApiError] = {}  # gRPC call -> what its reader gets

    def __len__(self) -> int:
        return len(self._opened)

    def add(self, call: Any) -> None:
        self._opened[call] = time.time()
        self._heard[call] = time.monotonic()

    def heard(self, call: Any) -> None:
        """`call` received a piece: it is alive."""
        if call in self._heard:
            self._heard[call] = time.monotonic()

    def discard(self, call: Any) -> ApiError | None:
        """Forget `call`; returns the error it was broken with, None if it was not."""
        self._opened.pop(call, None)
        self._heard.pop(call, None)
        return self._broken.pop(call, None)

    def break_all(self, reason: str, opened_before: float = math.inf, quiet_s: float = 0.0,
                  server_ok: bool = False) -> int:
        """Cancel every stream opened before `opened_before` (Unix time) that has received
        nothing for `quiet_s`; their readers get a 503 saying `reason` (`server_ok`: the
        server serves again, a move may go back to it). Returns how many."""
        now = time.monotonic()
        calls = [c for c, at in self._opened.items()
                 if at < opened_before and now - self._heard[c] >= quiet_s]
        for call in calls:
            del self._opened[call], self._heard[call]
            self._broken[call] = ApiError(503, f"the server lost the request: {reason}",
                                          server_ok=server_ok)
            call.cancel()
        return len(calls)


async def stream(client: grpcclient.InferenceServerClient, inputs: dict[str, Any],
                 parameters: dict[str, str], headers: dict[str, str] | None,
                 timeout_s: float, breaker: Breaker | None = None) -> AsyncIterator[Piece]:
    """The ensemble's responses to one request. Raises ApiError when the server refuses or
    fails it (a stream that fails after its first piece ends with finish_reason "error"), or
    503 when `breaker` breaks it."""
    tensors = ensemble_inputs(inputs)
    done = asyncio.Event()

    async def one_request() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": ENSEMBLE, "inputs": tensors, "parameters": parameters or None}
        await done.wait()  # keep our side open until the answer ends

    responses = client.stream_infer(one_request(), stream_timeout=timeout_s, headers=headers)
    breaker = Breaker() if breaker is None else breaker
    breaker.add(responses)
    try:
        async for result, error in responses:
            breaker.heard(responses)
            if error is not None:
                raise from_triton(str(error.message()))
            piece = _piece(result)
            if piece.finish_reason == FINISH_ERROR:
                raise from_triton(_text(result, "error_message"))
            yield piece
            if piece.finish_reason:
                return
        raise ApiError(503, "the server closed the stream before the request finished")
    except grpcclient.InferenceServerException as e:
        raise from_triton(str(e.message())) from None
    except grpc.aio.AioRpcError as e:  # the server is unreachable, or the stream broke
        raise ApiError(503, f"the server failed: {e.code().name}: {e.details()}") from None
    except asyncio.CancelledError:
        broken = breaker.discard(responses)
        if broken is None:
            raise  # our own task was cancelled (the client went away)
        raise broken from None
    finally:
        breaker.discard(responses)
        done.set()
        with contextlib.suppress(Exception):
            responses.cancel()


def _piece(result: Any) -> Piece:
    return Piece(
        text=_text(result, "text_output"),
        token_ids=[int(t) for t in _array(result, "output_ids")],
        logprobs=[float(x) for x in _array(result, "output_log_probs")],
        finish_reason=_text(result, "finish_reason"),
        num_input_tokens=int(next(iter(_array(result, "num_input_tokens")), 0)),
        num_output_tokens=int(next(iter(_array(result, "num_output_tokens")), 0)),
    )


def _array(result: Any, name: str) -> np.ndarray:
    arr = result.as_numpy(name)
    return np.zeros(0) if arr is None else arr.reshape(-1)


def _text(result: Any, name: str) -> str:
    arr = _array(result, name)
    return bytes(arr[0]).decode("utf-8", errors="replace") if arr.size else ""
