"""Property-based bad input through the running server: generated /generate bodies and gRPC
tensors (types, shapes, sizes, unicode, unknown and missing fields) get a client error or a
valid result, never a server error or a hang, and the server keeps serving without leaks."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from python_backends.wire import CLIENT_INPUTS
from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e
CASES_HTTP, CASES_GRPC = 300, 100
# Triton 2.51's HTTP front end answers some malformed bodies with 500 before any model runs
# (docs/platform.md); its messages start so. Any other server error fails the test.
TRITON_JSON_LIMITS = ("Unable to parse", "parameter key", "Expected JSON object for keyword")
NAMES = st.sampled_from(sorted(CLIENT_INPUTS)) | st.text(min_size=1, max_size=10)
# Small or refused lengths only: a valid request generates, and a case must stay short.
MAX_TOKENS = st.integers(-3, 6) | st.sampled_from([10**6, 2**31 - 1]) | st.text(max_size=4)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6)
RUN = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                    HealthCheck.too_slow])


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = draw(st.dictionaries(NAMES, JSON, max_size=5))
    body["max_tokens"] = draw(MAX_TOKENS)
    if draw(st.booleans()):
        body["text_input"] = draw(st.text(max_size=60))
    return body


@settings(RUN, max_examples=CASES_HTTP)
@given(body=bodies())
def test_generate_bodies(server: Server, body: dict[str, Any]) -> None:
    r = requests.post(f"{server.options.http_url}/v2/models/ensemble/generate",
                      data=json.dumps(body, allow_nan=True), timeout=120)
    if r.status_code == 500 and r.json()["error"].startswith(TRITON_JSON_LIMITS):
        return  # Triton's own JSON parser, before any model runs (docs/platform.md)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
    if r.status_code == 200:
        assert isinstance(r.json()["text_output"], str)
    else:
        assert r.json()["error"]


@st.composite
def tensors(draw: st.DrawFn) -> list[grpcclient.InferInput]:
    out = []
    for name in draw(st.lists(NAMES, max_size=4, unique=True)):
        dtype = draw(st.sampled_from([np.int32, np.int64, np.float32, np.bool_, np.object_]))
        shape = [1, draw(st.integers(0, 3))]
        n = shape[1]
        if dtype is np.object_:
            data = np.array([draw(st.lists(st.binary(max_size=20), min_size=n, max_size=n))],
                            dtype=np.object_).reshape(shape)
        else:
            data = np.array([draw(st.lists(st.integers(-9, 9), min_size=n, max_size=n))]
                            ).astype(dtype).reshape(shape)
        t = grpcclient.InferInput(name, shape, np_to_triton_dtype(np.dtype(dtype)))
        t.set_data_from_numpy(data)
        out.append(t)
    return out


@settings(RUN, max_examples=CASES_GRPC)
@given(inputs=tensors())
def test_grpc_tensors(server: Server, inputs: list[grpcclient.InferInput]) -> None:
    max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    max_tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    if not any(t.name() == "max_tokens" for t in inputs):
        inputs = [*inputs, max_tokens]
    results: list[Any] = []
    log_start = server.log_file.stat().st_size
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.options.grpc_port}")
    client.start_stream(callback=lambda result, error: results.append(error or result))
    try:
        client.async_stream_infer("ensemble", inputs)
    except InferenceServerException:
        return  # refused by the client library itself: nothing was sent
    finally:
        client.stop_stream()  # waits for the request to end
        client.close()
    assert results
    for r in results:  # a stream's errors carry a message, not a gRPC status
        assert isinstance(r, grpcclient.InferResult) or str(r.message()), r
    with server.log_file.open("rb") as log:  # and no model failed on the way
        log.seek(log_start)
        new = log.read().decode(errors="replace")
    assert "Traceback" not in new and "request failed" not in new, new[-2000:]


def test_server_serves_and_holds_nothing_after_the_properties(server: Server) -> None:
    out = server.client.generate("The capital of France is", max_tokens=4)
    assert out["text_output"]
    assert server.wait_idle() == 0
