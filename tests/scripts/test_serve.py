"""README's serve command: scripts/serve.sh comes up, answers, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

from python_backends.launcher import SHM_DIR, free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


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
         "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])],
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
        r = requests.post(f"http://127.0.0.1:{ports[0]}/v2/models/ensemble/generate",
                          json={"text_input": "The capital of France is", "max_tokens": 8},
                          timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["text_output"]
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
