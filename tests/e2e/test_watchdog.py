"""A model stub that dies is restarted: Triton's Python backend does not restart decoupled
stubs itself, so without the watchdog every later request would fail."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import pytest

from python_backends.bench.client import GenerateError, LLMClient, as_list
from python_backends.flag_board import NAME_PREFIX, SHM_DIR
from python_backends.metrics_text import metric_sum
from python_backends.procfs import live_stubs
from tests.e2e.conftest import (
    KILLED_BY_TESTS,
    KILLS_STUBS,
    MAX_TOKENS,
    PROMPTS,
    Reference,
    Server,
    newest_stub,
)

pytestmark = [pytest.mark.e2e, KILLS_STUBS]


def test_killed_front_stub_is_restarted(server: Server, reference: Reference) -> None:
    assert server.triton.process is not None and server.triton.watchdog is not None
    stub = newest_stub(server, "front")
    KILLED_BY_TESTS.add(stub.instance)
    os.kill(stub.pid, signal.SIGKILL)
    with pytest.raises(GenerateError, match="not healthy"):
        server.client.generate(PROMPTS[0], max_tokens=4)
    deadline = time.monotonic() + 90
    while True:  # the watchdog reloads the front within seconds
        try:
            out = server.client.generate(PROMPTS[0], max_tokens=MAX_TOKENS,
                                         exclude_input_in_output=True)
            break
        except GenerateError:
            assert time.monotonic() < deadline, "the front was not restarted"
            time.sleep(1.0)
    assert out["text_output"] == reference.text(PROMPTS[0])
    assert server.triton.watchdog.restarts[-1] == (stub.instance, "front")
    new = newest_stub(server, "front")
    assert new.pid != stub.pid
    log = server.log_file.read_text()
    assert f"[watchdog] {stub.instance}: stub process gone; reloading front" in log
    assert server.wait_idle() == 0


def test_engines_keep_serving_after_the_front_dies_mid_stream(
    server: Server, reference: Reference
) -> None:
    """The front's stub dies with sequences running on the worker, prefill and decode
    groups. Their responses can never be delivered (Triton 2.51 waits forever for the dead stub
    to take one), so each engine must drop that front's sequences and stall only its lane:
    after the watchdog's restart every path answers correctly and every KV block comes back."""
    assert server.triton.process is not None and server.triton.watchdog is not None
    server_pid = server.triton.process.pid
    doomed = LLMClient(server.options.http_url, timeout=20)  # Triton never fails these

    def stream(route: str) -> None:
        with contextlib.suppress(Exception):
            doomed.stream_collect("Tell me a long story about France. " * 8, max_tokens=400,
                                  route=route)

    threads = [threading.Thread(target=stream, args=(route,), daemon=True)
               for route in ("aggregated", "disaggregated") * 3]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(metric_sum(server.metrics(), "llm_kv_cache_blocks_used", model=m) > 0
                  for m in ("worker", "decode")):
        assert time.monotonic() < deadline, "the streams never reached the engines"
        time.sleep(0.2)
    stub = newest_stub(server, "front")
    KILLED_BY_TESTS.add(stub.instance)
    os.kill(stub.pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while not any(s.model == "front" and s.pid != stub.pid for s in live_stubs(server_pid)):
        assert time.monotonic() < deadline, "the front was not restarted"
        time.sleep(0.5)
    for route in ("aggregated", "disaggregated"):
        out = _generate_when_ready(server, route, deadline)
        assert as_list(out["output_ids"]) == reference.outputs[PROMPTS[0]], route
    # Orphans are aborted and their leases given up at once, except a lease whose answer was
    # already on its way to the dead front: that one expires (kv_lease_seconds, 30).
    assert server.wait_idle(timeout=45) == 0
    log = server.log_file.read_text()
    for instance in ("worker_0_0", "decode_0_0"):  # both had its sequences
        assert f"{instance}: caller {NAME_PREFIX}{stub.pid}_" in log, instance
    assert not list(SHM_DIR.glob(f"{NAME_PREFIX}{stub.pid}_*"))  # its board, removed for it
    for t in threads:
        t.join(30)


def _generate_when_ready(server: Server, route: str, deadline: float) -> dict[str, Any]:
    """A greedy generate on `route`, retried while the restarted front is still loading."""
    while True:
        try:
            return server.client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, route=route,
                                          exclude_input_in_output=True)
        except GenerateError:
            assert time.monotonic() < deadline, "the restarted front does not answer"
            time.sleep(1.0)
