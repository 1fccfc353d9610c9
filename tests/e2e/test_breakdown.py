"""Where a token's time goes, read from a running server: every serving process shows CPU time
for the tokens it served, and the engine's phases account for the worker's share of them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from python_backends.bench.breakdown import STEP_PHASES_METRIC, breakdown, server_pid, snapshot
from python_backends.engine.llm_engine import STEP_PHASES
from tests.e2e.conftest import PROMPTS, Server

pytestmark = pytest.mark.e2e

TOKENS = 32


def test_breakdown_of_a_load(server: Server) -> None:
    assert server.wait_idle() == 0
    port = server.options.metrics_port
    pid = server_pid(port)
    assert server.triton.process is not None and pid == server.triton.process.pid
    # Every phase's series exists from the engine's start, at zero or more.
    phases = {dict(k)["phase"] for k in server.metrics()[STEP_PHASES_METRIC]
              if dict(k)["model"] == "worker"}
    assert phases == set(STEP_PHASES)

    before = snapshot(pid, server.options.metrics_url)
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: server.client.stream_collect(
            p, max_tokens=TOKENS, end_id=-1, route="aggregated"), PROMPTS[:4]))
    wall = time.monotonic() - start
    tokens = sum(len(r.output_ids) for r in results)
    assert tokens == 4 * TOKENS
    b = breakdown(before, snapshot(pid, server.options.metrics_url), tokens, wall)

    for process in ("tritonserver", "front", "postprocessing", "worker"):
        assert b.cpu_ms[process] > 0, (process, b.cpu_ms)
    worker = b.phases_ms["worker"]
    assert worker["forward"] > 0 and worker["respond"] > 0, worker
    # Wall time on the loop thread cannot exceed the load's wall time.
    assert sum(worker.values()) <= 1e3 * wall / tokens, (worker, wall, tokens)
