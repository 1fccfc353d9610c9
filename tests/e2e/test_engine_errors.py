"""An engine error after a request's first token reaches the client as a clear error at once,
over HTTP SSE, HTTP non-streaming and gRPC streaming, on both paths, and every KV block comes
back. The error travels as data twice: in the engine's final response (a decoupled BLS call
never receives an error response that is not its first, so the request used to hang), and, on
a stream that already sent a chunk, in the client's final response (finish_reason "error" and
error_message: a Triton error there would leave the ensemble request in flight)."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from python_backends.bench.client import GenerateError
from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e
FAULT = {"engine_fault": "error_after_first_token"}
MESSAGE = "injected engine fault"
PROMPT = "The capital of France is"
ROUTES = ["aggregated", "disaggregated"]


@pytest.mark.parametrize("route", ROUTES)
def test_sse_stream_ends_with_the_error_right_after_its_first_token(
    server: Server, route: str
) -> None:
    times = []
    with pytest.raises(GenerateError) as e:
        for _event in server.client.stream(PROMPT, max_tokens=32, route=route, **FAULT):
            times.append(time.monotonic())
    failed = time.monotonic()
    assert MESSAGE in e.value.message and e.value.status == 200  # the stream had begun
    assert len(times) == 1 and failed - times[0] < 1.0  # the next step fails at once
    assert server.wait_idle() == 0


@pytest.mark.parametrize("route", ROUTES)
def test_non_streaming_request_gets_the_error(server: Server, route: str) -> None:
    start = time.monotonic()
    with pytest.raises(GenerateError) as e:
        server.client.generate(PROMPT, max_tokens=32, route=route, **FAULT)
    assert MESSAGE in e.value.message and e.value.status >= 400
    assert time.monotonic() - start < 10.0  # not the client's timeout
    assert server.wait_idle() == 0


@pytest.mark.parametrize("route", ROUTES)
def test_grpc_stream_gets_the_error(server: Server, route: str) -> None:
    events: queue.Queue[tuple[float, object]] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.options.grpc_port}")
    client.start_stream(callback=lambda result, error: events.put((time.monotonic(),
                                                                    error or result)))
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[PROMPT.encode()]], dtype=np.object_))
    stream = grpcclient.InferInput("stream", [1, 1], "BOOL")
    stream.set_data_from_numpy(np.array([[True]]))
    client.async_stream_infer("ensemble", [text, stream], parameters={"route": route, **FAULT})
    try:
        first_at, first = events.get(timeout=60)
        failed_at, error = events.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert isinstance(first, grpcclient.InferResult)
    assert isinstance(error, grpcclient.InferResult), error
    assert error.as_numpy("finish_reason").reshape(-1)[0] == b"error"
    assert MESSAGE in error.as_numpy("error_message").reshape(-1)[0].decode()
    assert first.as_numpy("error_message").reshape(-1)[0] == b""
    assert failed_at - first_at < 1.0
    assert server.wait_idle() == 0
