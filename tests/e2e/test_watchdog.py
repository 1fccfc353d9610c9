"""A model stub that dies is restarted: Triton's Python backend does not restart decoupled
stubs itself, so without the watchdog every later request would fail."""

from __future__ import annotations

import os
import signal
import time

import pytest

from python_backends.client import GenerateError
from python_backends.watchdog import live_stubs
from tests.e2e.conftest import KILLED_BY_TESTS, MAX_TOKENS, PROMPTS, Reference, Server


def test_killed_scheduler_stub_is_restarted(server: Server, reference: Reference) -> None:
    assert server.triton.process is not None and server.triton.watchdog is not None
    server_pid = server.triton.process.pid
    (stub,) = [s for s in live_stubs(server_pid) if s.model == "scheduler"]
    KILLED_BY_TESTS.add(stub.instance)
    os.kill(stub.pid, signal.SIGKILL)
    with pytest.raises(GenerateError, match="not healthy"):
        server.client.generate(PROMPTS[0], max_tokens=4)
    deadline = time.monotonic() + 90
    while True:  # the watchdog reloads the scheduler within seconds
        try:
            out = server.client.generate(PROMPTS[0], max_tokens=MAX_TOKENS,
                                         exclude_input_in_output=True)
            break
        except GenerateError:
            assert time.monotonic() < deadline, "the scheduler was not restarted"
            time.sleep(1.0)
    assert out["text_output"] == reference.text(PROMPTS[0])
    assert server.triton.watchdog.restarts[-1] == (stub.instance, "scheduler")
    (new,) = [s for s in live_stubs(server_pid) if s.model == "scheduler"]
    assert new.pid != stub.pid
    log = server.log_file.read_text()
    assert f"[watchdog] {stub.instance}: stub process gone; reloading scheduler" in log
    assert server.wait_idle() == 0
