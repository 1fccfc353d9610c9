"""Scheduling policies through the running server: every waiting request reaches the worker's
fair queue, which serves tenants in turn rather than in arrival order; a step budget set on the
worker bounds its steps."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from python_backends.bench.client import as_list
from python_backends.config import EngineConfig
from python_backends.engine.builder import engine_variant
from tests.e2e.conftest import (
    ENGINE_DIR,
    MAX_TOKENS,
    PROMPTS,
    Server,
    hf_greedy,
    poll_metric,
)

pytestmark = pytest.mark.e2e


def test_tenants_take_turns_behind_a_long_queue(server: Server, tmp_path: Path) -> None:
    """With one sequence running at a time, tenant A queues 64 requests and then B queues 2.
    First come, first served would start B's after all of A's; the deficit round robin starts
    them within a few admissions of their arrival at the worker. That also needs all of A's
    inside the worker's queue, while the server runs the Python backend's default thread pool
    (32 per instance): the worker accepts each call at once (serving.common.accepted). Without
    that, the rest waited in front of the worker in arrival order and B's came after them (40
    of A's started between B's arrival and start)."""
    one_at_a_time = engine_variant(ENGINE_DIR, tmp_path / "batch1", max_num_seqs=1)
    repo = server.options.repository()
    started: dict[str, float] = {}

    def run(name: str, tenant: str) -> None:
        for _ in server.client.stream(f"Tell me about request {name}", max_tokens=8, end_id=-1,
                                      tenant=tenant, route="aggregated"):
            started.setdefault(name, time.monotonic())

    with repo.reloaded("worker", engine_dir=str(one_at_a_time)), ThreadPoolExecutor(66) as pool:
        futures = [pool.submit(run, f"A{k}", "A") for k in range(64)]
        time.sleep(2.0)  # A's are queued (the first ones are done)
        b_sent = time.monotonic()
        futures += [pool.submit(run, f"B{k}", "B") for k in range(2)]
        for f in futures:
            f.result(timeout=300)
    b_started = max(started["B0"], started["B1"])
    a_before_b = [n for n, t in started.items() if n[0] == "A" and b_sent < t < b_started]
    a_after_b = [n for n, t in started.items() if n[0] == "A" and t > b_started]
    # The transit to the worker (HTTP, preprocessing, front on a busy 2-core machine) and a
    # round of A's credit let a few of A's start first; arrival order would let all of them.
    assert len(a_before_b) < 16, f"{len(a_before_b)} of A's started between B's arrival and start"
    assert len(a_after_b) >= 16, f"only {len(a_after_b)} of A's were still waiting"
    assert server.wait_idle() == 0


def test_a_step_budget_set_on_the_worker_bounds_its_steps_and_keeps_the_hf_output(
        server: Server) -> None:
    """`max_num_batched_tokens` below the engine's: the worker publishes it as its step budget
    and prefills prompts longer than it over several steps, with greedy output unchanged (four
    at once, so decode rows share the budget with prompt chunks); the engine's own again after."""
    prompts = [p * 4 for p in PROMPTS[:4]]  # 20 to 56 tokens: each longer than the budget
    expected = hf_greedy(prompts, MAX_TOKENS)

    def step_budget(want: int) -> float:  # an instance gone since (autoscaled) keeps its series
        return poll_metric([server.options.metrics_url], "llm_engine_step_tokens_max",
                           lambda got: got == want, 60, 0.2, instance="worker_0_0")

    with server.options.repository().reloaded("worker", max_num_batched_tokens="16"):
        assert step_budget(16) == 16, server.metrics().get("llm_engine_step_tokens_max")
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: server.client.generate(
                p, max_tokens=MAX_TOKENS, exclude_input_in_output=True, route="aggregated"),
                prompts))
        for prompt, out in zip(prompts, outs, strict=True):
            assert as_list(out["output_ids"]) == expected.outputs[prompt]
    built = EngineConfig.load(ENGINE_DIR).limits.max_num_batched_tokens
    assert step_budget(built) == built, server.metrics().get("llm_engine_step_tokens_max")
    assert server.wait_idle() == 0
