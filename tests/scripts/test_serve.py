"""README's serve command: scripts/serve.sh comes up (here with --api-key and a repository whose
front has tight admission limits), answers, enforces the key on HTTP, gRPC and the gateway it
starts while health stays open, refuses overload and rate-limited tenants with clear errors
while serving others, and stops cleanly on SIGTERM."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from python_backends import procfs
from python_backends.config import API_KEY_HEADER, GRPC_API_KEY_HEADER
from python_backends.metrics_text import scrape
from python_backends.net import free_port
from python_backends.ops.launcher import SHM_DIR

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-8f3a"


def _descendants(pid: int) -> set[int]:
    return {p.pid for p in procfs.running_descendants(pid)}


def _grpc_generate(port: int, headers: dict[str, str]) -> str:
    """Text of a gRPC streaming request, or the error message."""
    out: list[str] = []

    def callback(result: grpcclient.InferResult, error: Exception | None) -> None:
        text = result.as_numpy("text_output") if error is None else None
        out.append(str(error) if text is None else text.reshape(-1)[0].decode())

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    client.start_stream(callback=callback, headers=headers)
    inputs = []
    for name, value, dtype in [
        ("text_input", np.array([[b"The capital of France is"]], dtype=np.object_), "BYTES"),
        ("max_tokens", np.array([[8]], dtype=np.int32), "INT32"),
    ]:
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    # A refused stream may already be closed here; the callback has the reason either way.
    with contextlib.suppress(InferenceServerException):
        client.async_stream_infer("ensemble", inputs)
    client.stop_stream()
    client.close()
    return "".join(out)


def _tight_repository(tmp_path: Path) -> Path:
    repo = tmp_path / "model_repository"
    shutil.copytree(ROOT / "model_repository", repo)
    config = repo / "front" / "config.pbtxt"
    text = config.read_text()
    for key, value in {
        "max_waiting_requests": "2",
        "rate_limits": '{\\"limited\\": {\\"requests_per_s\\": 0.1, \\"burst_requests\\": 1}}',
    }.items():
        pattern = rf'(key: "{key}" value: {{ string_value: )"[^"]*"'
        replacement = f'\\g<1>"{value.replace(chr(92), chr(92) * 2)}"'
        text, n = re.subn(pattern, replacement, text)
        assert n == 1, key
    config.write_text(text)
    return repo


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = requests.post(url, json=body, headers={API_KEY_HEADER: KEY}, timeout=300)
    return r.status_code, r.json()


def _check_admission(url: str, grpc_port: int, metrics_url: str) -> None:
    short: dict[str, Any] = {"text_input": "Hello", "max_tokens": 4}
    assert _post(url, {**short, "tenant": "limited"})[0] == 200  # its burst of one
    status, out = _post(url, {**short, "tenant": "limited"})
    assert status >= 400 and "rate limited" in out["error"] and "'limited'" in out["error"]
    grpc_out = _grpc_generate(grpc_port, {GRPC_API_KEY_HEADER: KEY, "x-tenant": "limited"})
    assert "rate limited" in grpc_out  # the same tenant through gRPC metadata
    assert _post(url, {**short, "tenant": "other"})[0] == 200  # other tenants unaffected

    long_prompt: dict[str, Any] = {"text_input": "word " * 1500, "max_tokens": 4}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _post(url, long_prompt), range(8)))
    refused = [out["error"] for status, out in results if status != 200]
    assert refused and all("server overloaded" in e for e in refused)
    assert len(refused) < 8
    assert _post(url, short)[0] == 200  # still serving
    metrics = scrape(metrics_url)
    rejected = metrics["llm_requests_rejected_total"]
    assert rejected[frozenset({("model", "front"), ("reason", "rate_limited"),
                               ("tenant", "limited")})] == 2
    assert rejected[frozenset({("model", "front"), ("reason", "overloaded"),
                               ("tenant", "default")})] == len(refused)


def _check_gateway(url: str) -> None:
    """The gateway serve.sh starts beside the server: the same key, OpenAI's API."""
    chat: dict[str, Any] = {"model": "smollm2", "max_tokens": 16,
                            "messages": [{"role": "user",
                                          "content": "What is the capital of France?"}]}
    assert requests.post(url, json=chat, timeout=60).status_code == 401
    r = requests.post(url, json=chat, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"]


def test_serve_script_starts_answers_and_stops_cleanly(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(4)]
    shm_before = set(os.listdir(SHM_DIR))
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "serve.sh"), "--http-port", str(ports[0]),
         "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--api-key", KEY,
         "--gateway-port", str(ports[3]),
         "--model-repository", str(_tight_repository(tmp_path))],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        banner = ""
        while "[serve] ready" not in banner:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "serve.sh did not become ready"
            time.sleep(1)
            banner = (tmp_path / "serve.log").read_text()
        assert f"http://127.0.0.1:{ports[0]}/v2/models/ensemble/generate" in banner
        url = f"http://127.0.0.1:{ports[0]}/v2/models/ensemble/generate"
        body: dict[str, Any] = {"text_input": "The capital of France is", "max_tokens": 8}
        for headers in ({}, {API_KEY_HEADER: "wrong"}):
            r = requests.post(url, json=body, headers=headers, timeout=60)
            assert r.status_code == 403 and API_KEY_HEADER in r.json()["error"]
        r = requests.post(url, json=body, headers={API_KEY_HEADER: KEY}, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["text_output"]
        assert requests.get(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=10).ok
        assert "restricted" in _grpc_generate(ports[1], {})
        assert "restricted" in _grpc_generate(ports[1], {GRPC_API_KEY_HEADER: "wrong"})
        assert "Paris" in _grpc_generate(ports[1], {GRPC_API_KEY_HEADER: KEY})
        assert f"http://127.0.0.1:{ports[3]}/v1" in banner
        _check_gateway(f"http://127.0.0.1:{ports[3]}/v1/chat/completions")
        _check_admission(url, ports[1], f"http://127.0.0.1:{ports[2]}/metrics")
        assert len(_descendants(proc.pid)) >= 5  # tritonserver and its model stubs
        stubs = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:  # the test failed midway: stop the server the graceful way first
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                for pid in _descendants(proc.pid) | {proc.pid}:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        log.close()
    time.sleep(1)
    alive = [p for p in stubs if procfs.running(p)]
    assert not alive, f"orphan processes: {alive}"
    leaked = {n for n in set(os.listdir(SHM_DIR)) - shm_before if n.startswith("triton")}
    assert not leaked, f"leftover shared memory: {leaked}"
    assert "[serve] stopped" in (tmp_path / "serve.log").read_text()
