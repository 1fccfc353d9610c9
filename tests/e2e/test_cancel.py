"""Client cancellation (gRPC stream cancel, SSE disconnect) frees the sequence's KV blocks, and
every request (a non-streaming one whose client left included) ends inside Triton."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from python_backends.bench.client import GenerateError, LLMClient
from python_backends.metrics_text import metric_sum
from python_backends.ops.launcher import ServerOptions, TritonServer, free_port
from tests.e2e.conftest import ENGINE_DIR, Server

pytestmark = pytest.mark.e2e
LONG = 1500  # far more tokens than the test waits for
# How requests reports a client-side read timeout (the client then drops the connection).
TIMED_OUT = (requests.exceptions.Timeout, requests.exceptions.ConnectionError)


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
    assert server.wait_metric("llm_num_requests_running", 8) == 8
    assert server.kv_blocks_used() > 0
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
    assert server.wait_metric("llm_kv_cache_blocks_used", 1) > 0
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
    assert server.wait_metric("llm_kv_cache_blocks_used", 1, model="decode") > 0
    events.close()
    assert server.wait_idle(timeout=30) == 0  # worker, prefill and decode


def test_cancellation_storms_leave_nothing_in_flight(tmp_path: Path) -> None:
    """Dropped SSE streams, cancelled gRPC streams, non-streaming requests whose clients left
    and streams failing after their first chunk, on a server of its own: every one ends inside
    Triton too (Triton's shutdown finds no in-flight inference) and the server then stops at
    once, well inside its exit timeout."""
    log_file = tmp_path / "server.log"
    opts = ServerOptions(http_port=free_port(), grpc_port=free_port(),
                         metrics_port=free_port(), engine_dir=ENGINE_DIR, log_file=log_file,
                         exit_timeout_s=60, fault_injection=True)
    triton = TritonServer(opts)
    triton.start()
    try:
        triton.wait_ready(timeout_s=600)
        server = Server(opts, LLMClient(opts.http_url, timeout=60), log_file, triton)
        _storm(server)
        assert server.wait_idle(timeout=30) == 0
        assert metric_sum(server.metrics(), "llm_num_requests_running") == 0
    finally:
        t0 = time.monotonic()
        triton.stop()
        stop_s = time.monotonic() - t0
    log = log_file.read_text()
    assert "Found 0 model versions that have in-flight inferences" in log
    assert "in-flight inferences\"" not in log.replace(
        "Found 0 model versions that have in-flight inferences\"", "")
    assert stop_s < 20, f"the server took {stop_s:.0f} s to stop"
    print(f"24 requests cancelled in 3 ways, 8 failed mid-stream; server stopped in "
          f"{stop_s:.1f} s")


def _storm(server: Server) -> None:
    def drop_sse(i: int) -> None:
        events = server.client.stream(f"Story {i}: once upon a time", max_tokens=LONG,
                                      end_id=-1)
        for _ in range(3):
            next(events)
        events.close()

    def disconnect(i: int) -> None:
        # Triton 2.51 never notices this (docs/platform.md): the request runs to its end.
        client = LLMClient(server.options.http_url, timeout=0.5)
        with pytest.raises(TIMED_OUT):
            client.generate(f"Essay {i}: the history of", max_tokens=64, end_id=-1)

    def fail_midway(i: int) -> None:
        with pytest.raises(GenerateError, match="injected engine fault"):
            for _ in server.client.stream(f"Fable {i}: there was", max_tokens=LONG,
                                          engine_fault="error_after_first_token"):
                pass

    threads = [threading.Thread(target=f, args=(i,)) for i in range(8)
               for f in (drop_sse, disconnect, fail_midway)]
    for t in threads:
        t.start()
    streams = [_stream(server, f"Tale {i}: long ago") for i in range(8)]
    for _, started in streams:
        assert started.wait(120), "stream did not start"
    for client, _ in streams:
        client.stop_stream(cancel_requests=True)
        client.close()
    for t in threads:
        t.join(120)


def test_probes_never_reach_a_client_that_is_still_there(server: Server) -> None:
    """Requests quiet for longer than the probe interval (non-streaming ones generating for
    seconds, streams waiting behind long prompts) get exactly their answers: no empty response
    and, for /generate, still exactly one."""
    filler = " ".join(["A long and winding road leads to the sea."] * 40)
    answers: list[dict[str, object]] = []
    events: list[list[dict[str, object]]] = []

    def unary(i: int) -> None:
        answers.append(server.client.generate(f"Essay {i}:", max_tokens=96, end_id=-1))

    def stream(i: int) -> None:
        events.append(list(server.client.stream(f"{i} {filler}", max_tokens=8)))

    threads = [threading.Thread(target=unary, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert time.monotonic() - t0 > 2.0  # long enough to be probed
    assert [a["num_output_tokens"] for a in answers] == [96] * 4
    assert len(events) == 4
    for stream_events in events:
        assert stream_events and all(e["output_ids"] or e["finish_reason"]
                                     for e in stream_events)
