"""One request to a Triton server over gRPC streaming, as an async iterator of `Piece`s.
Closing the iterator early (the client went away, a stop string matched) cancels the gRPC
stream, which ends the request inside the server too (its engine frees the KV).

Two ways in, the same pieces out. Through the `ensemble` (preprocessing, front, postprocessing),
as any Triton client would. Or, with the gateway's tokenizer at hand (the default; the gateway
config's `pipeline`), past it: `preprocessing` validates and tokenizes the request in one unary
call, the `front` is called directly with the result, and its chunks are detokenized here. Each
streamed chunk then skips a hop through tritonserver and postprocessing's stub (half of what
tritonserver, the stubs and the gateway took per token; docs/benchmarks.md, "the gateway past
the ensemble"), and a direct caller's cancel reaches the front itself (docs/platform.md).

The OpenAI endpoints always ask the ensemble to stream (its `stream` input): the gateway
shapes non-streaming answers itself, and only a stream lets it stop early.

The gateway speaks Triton's gRPC API (KServe v2, tritonclient's generated stubs) on grpc.aio
itself: its request is built straight into protobuf and its pieces read straight from the raw
output bytes. tritonclient's own client would build numpy arrays both ways and a task per
stream to feed its request, all on the event loop that relays every token (together a third
of the gateway's time before a request's first token).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import TRITON_RESERVED_REQUEST_PARAMS, TRITON_RESERVED_REQUEST_PARAMS_PREFIX

from python_backends.detokenizer import incremental_text
from python_backends.gateway.errors import ApiError, from_triton
from python_backends.wire import (
    CLIENT_INPUTS,
    FINISH_ERROR,
    ClientChunk,
    ClientOutput,
    Kind,
    TokenizedRequest,
)

ENSEMBLE, PREPROCESSING, FRONT = "ensemble", "preprocessing", "front"
# Unary errors that say the server (not the request) failed: worth another server.
_SERVER_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT64_MAX = 2**64 - 1
MAX_MESSAGE = 2**31 - 1  # what tritonclient allows a message both ways
_SCALARS = {Kind.INT: "INT32", Kind.UINT64: "UINT64", Kind.FLOAT: "FP32", Kind.BOOL: "BOOL"}


@dataclass
class Piece:
    """One response of the ensemble."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    error: str = ""  # why it failed, with finish_reason "error"
    # with top_log_probs k: each token's k likeliest alternatives, token by token
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, output: ClientOutput) -> Piece:
        """The piece the ensemble answers with `output`'s tensors."""
        return cls(text=output.text_output, token_ids=output.output_ids,
                   logprobs=output.output_log_probs, finish_reason=output.finish_reason,
                   num_input_tokens=output.num_input_tokens,
                   num_output_tokens=output.num_output_tokens, error=output.error_message,
                   top_ids=output.output_top_ids, top_logprobs=output.output_top_log_probs)


class TritonClient:
    """One Triton server's gRPC API on a grpc.aio channel; made in the event loop that uses
    it."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE)])
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def is_server_ready(self, headers: dict[str, str] | None, timeout_s: float) -> bool:
        answer = await self._stub.ServerReady(service_pb2.ServerReadyRequest(),
                                              metadata=_metadata(headers), timeout=timeout_s)
        return bool(answer.ready)

    async def model_parameters(self, model: str, headers: dict[str, str] | None,
                               timeout_s: float) -> dict[str, str]:
        """A model's config parameters (name -> string value)."""
        answer = await self._stub.ModelConfig(service_pb2.ModelConfigRequest(name=model),
                                              metadata=_metadata(headers), timeout=timeout_s)
        return {k: v.string_value for k, v in answer.config.parameters.items()}

    async def infer(self, request: service_pb2.ModelInferRequest,
                    headers: dict[str, str] | None, timeout_s: float
                    ) -> service_pb2.ModelInferResponse:
        """One unary ModelInfer call."""
        return await self._stub.ModelInfer(request, metadata=_metadata(headers),
                                           timeout=timeout_s)

    def open_stream(self, headers: dict[str, str] | None, timeout_s: float) -> Any:
        """A ModelStreamInfer call (grpc.aio): `await write(request)`, then read its
        responses."""
        return self._stub.ModelStreamInfer(metadata=_metadata(headers), timeout=timeout_s)

    async def close(self) -> None:
        await self._channel.close()


def _metadata(headers: dict[str, str] | None) -> tuple[tuple[str, str], ...] | None:
    return tuple(headers.items()) if headers else None


def ensemble_request(values: dict[str, Any], parameters: dict[str, Any],
                     model: str = ENSEMBLE) -> service_pb2.ModelInferRequest:
    """The ensemble's request (or preprocessing's: the same inputs): one input tensor (batch of
    one) per name -> value, typed by the wire's declaration of each input
    (wire.CLIENT_INPUTS), and the request parameters. An unknown input, a value of the wrong
    type and a parameter Triton reserves or cannot carry are refused by name."""
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, value in values.items():
        spec = CLIENT_INPUTS.get(name)
        if spec is None:
            raise ApiError(400, f"invalid input '{name}': unknown input", name)
        tensor = request.inputs.add(name=name)
        contents = tensor.contents
        if spec.kind in (Kind.TEXT, Kind.TEXTS):
            items = value if isinstance(value, list) else [value]
            tensor.datatype = "BYTES"
            contents.bytes_contents.extend(str(v).encode() for v in items)
            tensor.shape.extend((1, len(items)))
            continue
        if spec.kind is Kind.INTS:
            if not isinstance(value, list) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and INT32_MIN <= v <= INT32_MAX
                    for v in value):
                raise ApiError(400, f"invalid input '{name}': expected a list of INT32 "
                               "integers", name)
            tensor.datatype = "INT32"
            contents.int_contents.extend(value)
            tensor.shape.extend((1, len(value)))
            continue
        tensor.datatype = _SCALARS[spec.kind]
        tensor.shape.extend((1, 1))
        try:
            _set_scalar(contents, spec.kind, value)
        except (TypeError, ValueError, OverflowError):
            raise ApiError(400, f"invalid input '{name}': expected {tensor.datatype}, got "
                           f"{value!r}", name) from None
    for key, value in parameters.items():
        _set_parameter(request.parameters[key], key, value)
    return request


def _set_scalar(contents: Any, kind: Kind, value: Any) -> None:
    """One value of `kind` into `contents`: an integer input takes an integer, a whole float
    or an integer's digits, in its type's range; a float input a number or a numeric string;
    a bool input any value's truth (as numpy converts). Raises TypeError, ValueError or
    OverflowError for a value that does not fit."""
    if kind is Kind.BOOL:
        contents.bool_contents.append(bool(value))
    elif kind is Kind.FLOAT:
        contents.fp32_contents.append(float(value))
    else:
        number = int(value)
        if number != value and not isinstance(value, str):
            raise ValueError(value)  # a float with a fraction: not an integer
        low, high = (0, UINT64_MAX) if kind is Kind.UINT64 else (INT32_MIN, INT32_MAX)
        if not low <= number <= high:
            raise OverflowError(value)
        (contents.uint64_contents if kind is Kind.UINT64 else contents.int_contents).append(
            number)


def _set_parameter(param: Any, key: str, value: Any) -> None:
    if key in TRITON_RESERVED_REQUEST_PARAMS or key.startswith(
            TRITON_RESERVED_REQUEST_PARAMS_PREFIX):
        raise ApiError(400, f"invalid parameter '{key}': reserved by Triton", key)
    if isinstance(value, str):
        param.string_param = value
    elif isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int) and -(2**63) <= value < 2**63:
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        raise ApiError(400, f"invalid parameter '{key}': expected a string, a number or a "
                       f"boolean, got {value!r}", key)


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


async def stream(client: TritonClient, inputs: dict[str, Any], parameters: dict[str, Any],
                 headers: dict[str, str] | None, timeout_s: float,
                 breaker: Breaker | None = None, tokenizer: Any = None
                 ) -> AsyncIterator[Piece]:
    """The responses to one request: the ensemble's, or with `tokenizer` (the server's) the
    front's, detokenized here. Raises ApiError when the server refuses or fails it (a stream
    that fails after its first piece ends with finish_reason "error"), or 503 when `breaker`
    breaks it."""
    read: Callable[[service_pb2.ModelInferResponse], Piece | None] = read_piece
    if tokenizer is None:
        request = ensemble_request(inputs, parameters)
    else:
        request = await _front_request(client, inputs, parameters, headers, timeout_s)
        read = functools.partial(read_chunk, tokenizer)
    call = client.open_stream(headers, timeout_s)  # our side stays open until the answer ends
    breaker = Breaker() if breaker is None else breaker
    breaker.add(call)
    try:
        await call.write(request)
        async for response in call:
            breaker.heard(call)
            if response.error_message:
                raise from_triton(response.error_message)
            piece = read(response.infer_response)
            if piece is None:
                continue  # the front's probe for a client gone away: a direct call needs none
            if piece.finish_reason == FINISH_ERROR:
                raise from_triton(piece.error)
            yield piece
            if piece.finish_reason:
                return
        raise ApiError(503, "the server closed the stream before the request finished")
    except grpc.aio.AioRpcError as e:  # the server is unreachable, or the stream broke
        raise ApiError(503, f"the server failed: {e.code().name}: {e.details()}") from None
    except asyncio.CancelledError:
        broken = breaker.discard(call)
        if broken is None:
            raise  # our own task was cancelled (the client went away)
        raise broken from None
    finally:
        breaker.discard(call)
        with contextlib.suppress(Exception):
            call.cancel()


async def _front_request(client: TritonClient, inputs: dict[str, Any],
                         parameters: dict[str, Any], headers: dict[str, str] | None,
                         timeout_s: float) -> service_pb2.ModelInferRequest:
    """The front's request: the ensemble inputs validated and tokenized by the server's
    preprocessing (its limits, its tokenizer, its fault-injection switch), passed on as they
    came back. A refusal is the same ApiError the ensemble's would be."""
    try:
        answer = await client.infer(ensemble_request(inputs, parameters, PREPROCESSING),
                                    headers, timeout_s)
    except grpc.aio.AioRpcError as e:
        if e.code() in _SERVER_DOWN:
            raise ApiError(503, f"the server failed: {e.code().name}: {e.details()}") from None
        raise from_triton(e.details() or e.code().name) from None
    (name,) = TokenizedRequest.names()
    request = service_pb2.ModelInferRequest(model_name=FRONT)
    for output, raw in zip(answer.outputs, answer.raw_output_contents, strict=False):
        if output.name == name:
            request.inputs.add(name=name, datatype=output.datatype, shape=output.shape)
            request.raw_input_contents.append(raw)
    if not request.inputs:
        raise ApiError(500, f"preprocessing answered without {name}")
    return request


# A response's outputs: name -> its raw bytes.
Outputs = dict[str, bytes]


def read_piece(response: service_pb2.ModelInferResponse) -> Piece:
    """One response of the ensemble."""
    outputs = _raw_outputs(response)
    return Piece(
        text=_text(outputs, "text_output"),
        token_ids=_ints(outputs, "output_ids"),
        logprobs=_floats(outputs, "output_log_probs"),
        finish_reason=_text(outputs, "finish_reason"),
        num_input_tokens=next(iter(_ints(outputs, "num_input_tokens")), 0),
        num_output_tokens=next(iter(_ints(outputs, "num_output_tokens")), 0),
        error=_text(outputs, "error_message"),
        top_ids=_ints(outputs, "output_top_ids"),
        top_logprobs=_floats(outputs, "output_top_log_probs"),
    )


def read_chunk(tokenizer: Any, response: service_pb2.ModelInferResponse) -> Piece | None:
    """One response of the front (a packed wire.ClientChunk) as the ensemble's postprocessing
    would have answered it: its tokens' text; None for a probe, which reports nothing."""
    name = ClientChunk.PACKED
    raw = _raw_outputs(response).get(name)
    if raw is None:
        raise ApiError(500, f"the front answered without {name}")
    chunk = ClientChunk.unpack(raw)
    if chunk.is_probe:
        return None
    return Piece.of(chunk.output(incremental_text(tokenizer, chunk.tokens, chunk.prefix_len)))


def _raw_outputs(response: service_pb2.ModelInferResponse) -> Outputs:
    """A response's outputs by name: Triton's gRPC endpoint sends every output's data as raw
    bytes (raw_output_contents, in the order of the outputs)."""
    return {o.name: raw for o, raw in zip(response.outputs, response.raw_output_contents,
                                          strict=False)}


def _ints(outputs: Outputs, name: str) -> list[int]:
    """An INT32 output's values (little-endian, as this host)."""
    raw = outputs.get(name, b"")
    return memoryview(raw).cast("i").tolist() if raw else []


def _floats(outputs: Outputs, name: str) -> list[float]:
    """An FP32 output's values."""
    raw = outputs.get(name, b"")
    return [float(x) for x in memoryview(raw).cast("f")] if raw else []


def _text(outputs: Outputs, name: str) -> str:
    """A BYTES output's first element: a 4-byte little-endian length, then the bytes."""
    raw = outputs.get(name, b"")
    if len(raw) < 4:
        return ""
    size = int.from_bytes(raw[:4], "little")
    return raw[4:4 + size].decode("utf-8", errors="replace")
