"""Client cancellation (gRPC stream cancel, SSE disconnect) frees the sequence's KV blocks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from python_backends.client import metric_sum
from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e
LONG = 1500  # far more tokens than the test waits for


def _stream(
    server: Server, prompt: str
) -> tuple[grpcclient.InferenceServerClient, threading.Event]:
    started = threading.Event()
    count = [0]

    def callback(result: grpcclient.InferResult, error: Exception | None) -> None:
        if error is None and result.as_numpy("text_output") is not None:
            count[0] += 1
            if count[0] >= 2:
                started.set()

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.options.grpc_port}")
    client.start_stream(callback=callback)
    inputs = []
    for name, value, dtype in [
        ("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
        ("max_tokens", np.array([[LONG]], dtype=np.int32), "INT32"),
        ("stream", np.array([[True]]), "BOOL"),
        ("end_id", np.array([[-1]], dtype=np.int32), "INT32"),  # never stops on its own
    ]:
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    client.async_stream_infer("ensemble", inputs)
    return client, started


def test_cancelling_8_grpc_streams_frees_kv(server: Server) -> None:
    streams = [_stream(server, f"Story number {i}: once upon a time") for i in range(8)]
    for _, started in streams:
        assert started.wait(120), "stream did not start"
    metrics = server.metrics()
    assert metric_sum(metrics, "llm_kv_cache_blocks_used") > 0
    assert metric_sum(metrics, "llm_num_requests_running") == 8
    t0 = time.monotonic()
    for client, _ in streams:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert server.wait_idle(timeout=30) == 0
    assert metric_sum(server.metrics(), "llm_num_requests_running") == 0
    print(f"KV freed {time.monotonic() - t0:.2f}s after cancelling 8 streams")


def test_sse_disconnect_frees_kv(server: Server) -> None:
    events = server.client.stream("Tell me a long story", max_tokens=LONG, end_id=-1)
    for _ in range(3):
        next(events)
    assert server.kv_blocks_used() > 0
    events.close()  # closing the generator drops the HTTP connection
    assert server.wait_idle(timeout=30) == 0


@pytest.mark.parametrize("transport", ["nixl", "host_shm"])
def test_disconnect_on_the_disaggregated_path_frees_kv_in_every_group(
    server: Server, transport: str
) -> None:
    events = server.client.stream("Tell me a long story", max_tokens=LONG, end_id=-1,
                                  route="disaggregated", kv_transport=transport)
    for _ in range(3):  # the first token from prefill, then decode's
        next(events)
    used = server.metrics()["llm_kv_cache_blocks_used"]
    assert sum(v for k, v in used.items() if ("model", "decode") in k) > 0
    events.close()
    assert server.wait_idle(timeout=30) == 0  # worker, prefill and decode
