"""The ensemble's request, its input tensors typed by the wire's declaration of each input;
its responses read from their raw bytes as tritonclient reads them; streams the gateway breaks
when their server has lost them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import serialize_byte_tensor

from python_backends.front.tenancy import CacheSharing
from python_backends.gateway.backends import Backend
from python_backends.gateway.config import BackendConfig
from python_backends.gateway.errors import ApiError
from python_backends.gateway.triton import (
    Breaker,
    Piece,
    ensemble_request,
    read_piece,
    stream,
)
from python_backends.wire import ClientChunk


def test_inputs_take_the_ensembles_types_and_shapes() -> None:
    request = ensemble_request(
        {"text_input": "Hi", "max_tokens": 3, "temperature": 0.5, "stream": True,
         "resume_ids": [5, 6, 7], "stop_words": ["a", "b"], "seed": 2**63},
        {"tenant": "acme", "retries": 2, "strict": True, "ratio": 0.5})
    assert request.model_name == "ensemble"
    tensors = {t.name: t for t in request.inputs}
    assert {n: (t.datatype, list(t.shape)) for n, t in tensors.items()} == {
        "text_input": ("BYTES", [1, 1]), "max_tokens": ("INT32", [1, 1]),
        "temperature": ("FP32", [1, 1]), "stream": ("BOOL", [1, 1]),
        "resume_ids": ("INT32", [1, 3]), "stop_words": ("BYTES", [1, 2]),
        "seed": ("UINT64", [1, 1])}
    c = {n: t.contents for n, t in tensors.items()}
    assert list(c["text_input"].bytes_contents) == [b"Hi"]
    assert list(c["stop_words"].bytes_contents) == [b"a", b"b"]
    assert list(c["max_tokens"].int_contents) == [3]
    assert list(c["resume_ids"].int_contents) == [5, 6, 7]
    assert list(c["temperature"].fp32_contents) == [0.5]
    assert list(c["stream"].bool_contents) == [True]
    assert list(c["seed"].uint64_contents) == [2**63]
    p = request.parameters
    assert (p["tenant"].string_param, p["retries"].int64_param, p["strict"].bool_param,
            p["ratio"].double_param) == ("acme", 2, True, 0.5)


@pytest.mark.parametrize(("inputs", "field"), [
    ({"colour": "red"}, "colour"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 3.5}, "max_tokens"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"temperature": "warm"}, "temperature"),
    ({"resume_ids": [1, "x"]}, "resume_ids"),
    ({"resume_ids": 3}, "resume_ids"),
    ({"resume_ids": [2**40]}, "resume_ids"),
])
def test_bad_values_are_refused_by_name(inputs: dict[str, object], field: str) -> None:
    with pytest.raises(ApiError) as e:
        ensemble_request(inputs, {})
    assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize(("parameters", "field"), [
    ({"timeout": 5}, "timeout"),  # Triton's own, as tritonclient refuses them
    ({"triton_enable_empty_final_response": True}, "triton_enable_empty_final_response"),
    ({"tags": ["a"]}, "tags"),
    ({"limits": {"a": 1}}, "limits"),
    ({"big": 2**70}, "big"),
])
def test_bad_parameters_are_refused_by_name(parameters: dict[str, object], field: str) -> None:
    with pytest.raises(ApiError) as e:
        ensemble_request({"text_input": "x"}, parameters)
    assert e.value.status == 400 and e.value.param == field


def _response(**outputs: np.ndarray) -> service_pb2.ModelInferResponse:
    """A response as Triton's gRPC endpoint sends it: every output's data as raw bytes."""
    response = service_pb2.ModelInferResponse(model_name="ensemble")
    for name, array in outputs.items():
        bytes_typed = array.dtype == np.object_
        response.outputs.add(name=name, datatype="BYTES" if bytes_typed else "INT32"
                             if array.dtype == np.int32 else "FP32", shape=array.shape)
        raw = serialize_byte_tensor(array).item() if bytes_typed else array.tobytes()
        response.raw_output_contents.append(raw)
    return response


def test_pieces_are_read_from_raw_outputs_as_tritonclient_reads_them() -> None:
    response = _response(
        text_output=np.array(["Caf\u00e9 \u2615".encode()], dtype=np.object_),
        finish_reason=np.array([b"error"], dtype=np.object_),
        error_message=np.array([b"engine lost"], dtype=np.object_),
        num_input_tokens=np.array([12], dtype=np.int32),
        num_output_tokens=np.array([3], dtype=np.int32),
        output_ids=np.array([7, -1, 2**31 - 1], dtype=np.int32),
        output_log_probs=np.array([-0.25, -1.5, 0.0], dtype=np.float32))
    piece = read_piece(response)
    reference = InferResult(response)  # tritonclient's own reading of the same response
    assert piece == Piece(
        text=bytes(reference.as_numpy("text_output")[0]).decode(),
        token_ids=reference.as_numpy("output_ids").tolist(),
        logprobs=reference.as_numpy("output_log_probs").tolist(),
        finish_reason=bytes(reference.as_numpy("finish_reason")[0]).decode(),
        num_input_tokens=int(reference.as_numpy("num_input_tokens")[0]),
        num_output_tokens=int(reference.as_numpy("num_output_tokens")[0]),
        error=bytes(reference.as_numpy("error_message")[0]).decode())
    assert piece.text == "Caf\u00e9 \u2615" and piece.token_ids == [7, -1, 2**31 - 1]


def test_a_response_without_some_outputs_reads_as_empty() -> None:
    response = _response(text_output=np.array([b""], dtype=np.object_),
                         output_ids=np.zeros(0, dtype=np.int32))
    assert read_piece(response) == Piece()


class SilentStream:
    """A gRPC stream whose server never answers (its front died): reading waits until the
    call is cancelled, which raises CancelledError in the reader, as grpc.aio does."""

    def __init__(self) -> None:
        self._cancelled = asyncio.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    async def write(self, request: Any) -> None:
        pass

    def __aiter__(self) -> SilentStream:
        return self

    async def __anext__(self) -> Any:
        await self._cancelled.wait()
        raise asyncio.CancelledError


class SilentClient:
    def open_stream(self, headers: Any, timeout_s: float) -> SilentStream:
        return SilentStream()


async def _silent_reader(breaker: Breaker) -> asyncio.Task[list[Piece]]:
    """A task reading a stream whose server never answers, once the stream is open."""
    async def read() -> list[Piece]:
        return [p async for p in stream(SilentClient(), {"text_input": "x"},  # type: ignore[arg-type]
                                        {}, None, 60.0, breaker)]

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.05)
    return reader


def test_a_stream_its_server_lost_ends_with_a_retryable_error() -> None:
    async def run() -> None:
        breaker = Breaker()
        reader = await _silent_reader(breaker)
        assert len(breaker) == 1
        assert breaker.break_all("its front restarted") == 1
        with pytest.raises(ApiError) as e:
            await asyncio.wait_for(reader, 5)
        assert e.value.retryable and "its front restarted" in e.value.message
        assert len(breaker) == 0

    asyncio.run(run())


def test_a_reader_that_goes_away_is_cancelled_not_broken() -> None:
    async def run() -> None:
        breaker = Breaker()
        reader = await _silent_reader(breaker)
        reader.cancel()  # the client went away: not an error to move
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert len(breaker) == 0

    asyncio.run(run())


class Tokens:
    """A tokenizer whose every id is one character (ord)."""

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(map(chr, ids))


def _chunk(tokens: list[int], prefix_len: int, finish_reason: str = "",
           error: str = "") -> service_pb2.ModelStreamInferResponse:
    chunk = ClientChunk("board", 3, tokens, prefix_len, tokens[prefix_len:], finish_reason, 4,
                        len(tokens), -1.0, [-0.5] * (len(tokens) - prefix_len), error, [], [])
    answer = service_pb2.ModelStreamInferResponse()
    answer.infer_response.outputs.add(name="CHUNK", datatype="UINT8")
    answer.infer_response.raw_output_contents.append(chunk.pack())
    return answer


class ScriptedStream(SilentStream):
    """A front's stream answering the responses it is given, then silent."""

    def __init__(self, responses: list[Any]) -> None:
        super().__init__()
        self.responses = responses
        self.written: list[Any] = []

    async def write(self, request: Any) -> None:
        self.written.append(request)

    async def __anext__(self) -> Any:
        if self.responses:
            return self.responses.pop(0)
        return await super().__anext__()


class FrontClient:
    """A server whose preprocessing answers `tokenized` (or fails with `error`) and whose front
    answers `responses`."""

    def __init__(self, responses: list[Any], error: Exception | None = None) -> None:
        self.inferred: list[Any] = []
        self.error = error
        self.stream = ScriptedStream(responses)

    async def infer(self, request: Any, headers: Any, timeout_s: float) -> Any:
        self.inferred.append(request)
        if self.error is not None:
            raise self.error
        answer = service_pb2.ModelInferResponse()
        answer.outputs.add(name="REQUEST", datatype="BYTES", shape=[1, 1])
        answer.raw_output_contents.append(serialize_byte_tensor(
            np.array([b'{"prompt": "tokenized"}'], dtype=np.object_)).item())
        return answer

    def open_stream(self, headers: Any, timeout_s: float) -> ScriptedStream:
        return self.stream


def _through_front(client: FrontClient) -> list[Piece]:
    async def read() -> list[Piece]:
        return [p async for p in stream(client, {"text_input": "Hi", "max_tokens": 4},  # type: ignore[arg-type]
                                        {"tenant": "acme"}, None, 60.0, tokenizer=Tokens())]
    return asyncio.run(read())


def test_the_front_pipeline_passes_preprocessing_on_and_detokenizes_its_chunks() -> None:
    probe = ClientChunk.probe("board", 3)
    answer = service_pb2.ModelStreamInferResponse()
    answer.infer_response.outputs.add(name="CHUNK", datatype="UINT8")
    answer.infer_response.raw_output_contents.append(probe.pack())
    client = FrontClient([_chunk([72, 105], 0), answer, _chunk([72, 105, 33, 33], 2, "stop")])
    pieces = _through_front(client)
    [preprocess] = client.inferred
    assert preprocess.model_name == "preprocessing"
    assert {t.name for t in preprocess.inputs} == {"text_input", "max_tokens"}
    assert preprocess.parameters["tenant"].string_param == "acme"
    [request] = client.stream.written
    assert request.model_name == "front" and [t.name for t in request.inputs] == ["REQUEST"]
    assert request.raw_input_contents[0].endswith(b'{"prompt": "tokenized"}')
    assert [p.text for p in pieces] == ["Hi", "!!"]  # the probe reads as nothing
    assert pieces[1] == Piece(text="!!", token_ids=[33, 33], logprobs=[-0.5, -0.5],
                              finish_reason="stop", num_input_tokens=4, num_output_tokens=4)


def test_the_front_pipeline_raises_a_failed_stream_and_a_refused_request() -> None:
    with pytest.raises(ApiError) as e:
        _through_front(FrontClient([_chunk([72], 0), _chunk([], 0, "error", "engine lost")]))
    assert e.value.status == 500 and "engine lost" in e.value.message

    class Refused(grpc.aio.AioRpcError):
        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    refused = FrontClient([], Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                      "invalid input 'max_tokens': must be >= 1"))
    with pytest.raises(ApiError) as e:
        _through_front(refused)
    assert (e.value.status, e.value.message) == (400, "invalid input 'max_tokens': must be >= 1")
    assert not refused.stream.written  # no front call for a refused request
    with pytest.raises(ApiError) as e:
        _through_front(FrontClient([], Refused(grpc.StatusCode.UNAVAILABLE, "connection reset")))
    assert e.value.retryable


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_a_restarted_front_breaks_the_streams_opened_before_it() -> None:
    backend = Backend(BackendConfig(name="a", grpc="127.0.0.1:1", metrics="http://x"))
    old, new = FakeCall(), FakeCall()
    backend.breaker.add(old)
    backend._watch_front(time.time() - 60)
    # the front the gateway first saw: nothing to break
    assert not old.cancelled
    restart = time.time()
    time.sleep(0.01)
    backend.breaker.add(new)  # opened after the new front started
    backend._watch_front(restart)
    assert old.cancelled and not new.cancelled
    broken = backend.breaker.discard(old)
    assert broken is not None and broken.server_ok and "its front restarted" in broken.message
    assert backend.breaker.discard(new) is None


def test_a_silent_server_breaks_only_the_streams_that_are_quiet_too() -> None:
    breaker = Breaker()
    quiet, talking = FakeCall(), FakeCall()
    breaker.add(quiet)
    breaker.add(talking)
    time.sleep(0.05)
    breaker.heard(talking)
    assert breaker.break_all("it has not answered for 3 s", quiet_s=0.04) == 1
    assert quiet.cancelled and not talking.cancelled and len(breaker) == 1


class ConfigClient:
    """A server's front config as the gateway reads it; None: the read fails."""

    def __init__(self) -> None:
        self.shared: str | None = ""
        self.reads = 0

    async def model_parameters(self, model: str, headers: Any, timeout_s: float
                               ) -> dict[str, str]:
        self.reads += 1
        if self.shared is None:
            raise ConnectionError("no front")
        return {"prefix_cache_shared_tenants": self.shared}


def test_the_fronts_cache_sharing_is_read_once_per_start_of_the_front() -> None:
    backend = Backend(BackendConfig(name="a", grpc="127.0.0.1:1", metrics="http://x"))
    client = ConfigClient()
    backend.client, backend.ready = client, True

    def check(started: float | None) -> None:
        asyncio.run(backend._read_cache_sharing(started, 1.0))

    check(None)  # no front on this server: nothing to read, each tenant its own cache
    assert client.reads == 0 and backend.cache_sharing == CacheSharing()
    client.shared = None
    check(100.0)  # unreadable: the default, asked again next time
    check(100.0)
    assert client.reads == 2 and backend.cache_sharing == CacheSharing()
    client.shared = "a,b"
    check(100.0)
    check(100.0)  # read once for this front
    assert client.reads == 3 and backend.cache_sharing == CacheSharing.parse("a,b")
    client.shared = ""
    check(200.0)  # the front restarted: read again
    assert client.reads == 4 and backend.cache_sharing == CacheSharing()
