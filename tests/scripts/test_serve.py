"""README's serve command: scripts/serve.sh comes up (here with --api-key), answers, enforces
the key on HTTP and gRPC while health stays open, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from python_backends.launcher import API_KEY_HEADER, GRPC_API_KEY_HEADER, SHM_DIR, free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-8f3a"


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True)
    children: dict[int, list[int]] = {}
    for line in out.stdout.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


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
    client.async_stream_infer("ensemble", inputs)
    client.stop_stream()
    client.close()
    return "".join(out)


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_serve_script_starts_answers_and_stops_cleanly(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    shm_before = set(os.listdir(SHM_DIR))
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "serve.sh"), "--http-port", str(ports[0]),
         "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--api-key", KEY],
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
        stubs = _descendants(proc.pid)
        assert len(stubs) >= 5  # tritonserver and its model stubs
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    time.sleep(1)
    alive = [p for p in stubs if _running(p)]
    assert not alive, f"orphan processes: {alive}"
    leaked = {n for n in set(os.listdir(SHM_DIR)) - shm_before if n.startswith("triton")}
    assert not leaked, f"leftover shared memory: {leaked}"
    assert "[serve] stopped" in (tmp_path / "serve.log").read_text()
