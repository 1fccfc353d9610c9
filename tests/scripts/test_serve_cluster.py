"""README's cluster command: scripts/serve_cluster.sh starts a front and a worker server (the
smallest cluster: the front's aggregated group on the other server), both requiring a key that
the front's calls to the worker carry; the front answers; Ctrl-C stops every server and leaves
no process or shared memory behind."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from python_backends import procfs
from python_backends.config import API_KEY_HEADER
from python_backends.ops.launcher import SHM_DIR
from tests.scripts.test_serve import ROOT, _descendants

pytestmark = pytest.mark.e2e
KEY = "cluster-key-51c2"


def _free_run(n: int) -> int:
    """The first of n consecutive ports free on 127.0.0.1 now."""
    for _ in range(100):
        base = random.randrange(20000, 60000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def test_serve_cluster_starts_answers_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    base = _free_run(6)
    shm_before = set(os.listdir(SHM_DIR))
    out = tmp_path / "cluster.out"
    with out.open("w") as log:
        proc = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "serve_cluster.sh"), "--prefill", "0", "--decode",
             "0", "--worker", "1", "--base-port", str(base), "--gateway-port", "0",
             "--api-key", KEY, "--log-dir", str(tmp_path / "logs")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while "[cluster] ready" not in out.read_text():
            assert proc.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, "serve_cluster.sh did not become ready"
            time.sleep(1)
        assert f"worker   gRPC 127.0.0.1:{base + 4}" in out.read_text()
        url = f"http://127.0.0.1:{base}/v2/models/ensemble/generate"
        body: dict[str, Any] = {"text_input": "The capital of France is", "max_tokens": 8}
        assert requests.post(url, json=body, timeout=60).status_code == 403
        r = requests.post(url, json=body, headers={API_KEY_HEADER: KEY}, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["text_output"], r.text
        processes = _descendants(proc.pid)
        assert len(processes) >= 6  # two tritonservers and their stubs
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(1)
    assert not [p for p in processes if procfs.running(p)], out.read_text()[-2000:]
    leaked = {n for n in set(os.listdir(SHM_DIR)) - shm_before if n.startswith("triton")}
    assert not leaked, f"leftover shared memory: {leaked}"
    assert "[cluster] stopped" in out.read_text()
