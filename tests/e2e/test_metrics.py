"""The minimal metrics are on Triton's metrics port and move under load."""

from __future__ import annotations

import time
from typing import Any

import pytest

from python_backends.metrics_text import metric_sum
from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e


GAUGES = ("llm_kv_cache_blocks_used", "llm_kv_cache_blocks_total", "llm_kv_cache_usage_ratio",
          "llm_num_requests_running", "llm_num_requests_waiting", "llm_num_preemptions_total",
          "llm_engine_healthy", "llm_kv_block_size_tokens", "llm_engine_step_tokens_max")
INSTANCES = {"worker_0_0", "prefill_0_0", "decode_0_0"}


def published(server: Server, timeout: float = 60.0) -> dict[str, Any]:
    """The metrics once every instance's engine has published its gauges and the worker's is
    healthy: an engine the watchdog just reloaded (tests/e2e/test_migration.py) publishes
    them when it is ready, a moment after its stub has started."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        missing = [name for name in GAUGES
                   if not {dict(k)["instance"] for k in metrics.get(name, {})} >= INSTANCES]
        if not missing and metric_sum(metrics, "llm_engine_healthy", instance="worker_0_0") == 1:
            return metrics
        waiting_for = missing or "llm_engine_healthy of worker_0_0"
        assert time.monotonic() < deadline, f"not published in {timeout:.0f} s: {waiting_for}"
        time.sleep(0.5)


def test_metrics_present_and_moving(server: Server) -> None:
    before = published(server)
    for name in GAUGES:
        labels = {dict(k)["instance"] for k in before[name]}
        # Every group; an instance removed by a resize (tests/e2e/test_autoscaler.py) keeps
        # its series in Triton 2.51, zeroed (EngineMetrics.retire).
        assert labels >= INSTANCES, name
        assert {dict(k)["model"] for k in before[name]} == {"worker", "prefill", "decode"}
    assert metric_sum(before, "llm_kv_cache_blocks_total", instance="worker_0_0") == 1024
    assert metric_sum(before, "llm_engine_healthy", instance="worker_0_0") == 1
    assert metric_sum(before, "llm_engine_ranks", instance="worker_0_0", device="cpu") == 1
    assert metric_sum(before, "llm_engine_ranks", instance="prefill_0_0", device="cpu") == 1
    assert metric_sum(before, "llm_kv_cache_blocks_total", instance="prefill_0_0") == 512
    result = server.client.stream_collect("Count to ten:", max_tokens=12, end_id=-1,
                                          route="aggregated")
    assert len(result.output_ids) == 12
    after = server.metrics()
    ttft = "llm_time_to_first_token_seconds"
    tpot = "llm_time_per_output_token_seconds"
    assert metric_sum(after, f"{ttft}_count") == metric_sum(before, f"{ttft}_count") + 1
    assert metric_sum(after, f"{tpot}_count") == metric_sum(before, f"{tpot}_count") + 1
    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    for name in ("llm_request_queue_time_seconds_count", "llm_request_prefill_time_seconds_count",
                 "llm_request_decode_time_seconds_count"):
        assert delta(name, model="worker") == 1, name
    assert delta("llm_e2e_request_latency_seconds_count") == 1
    assert delta("llm_prompt_tokens_total") == result.num_input_tokens > 0
    assert delta("llm_generation_tokens_total") == 12
    assert delta("llm_requests_finished_total", finish_reason="length") == 1
    assert delta("llm_prompt_tokens_computed_total", model="worker") == result.num_input_tokens
    for name in ("llm_prefix_cache_queries_total", "llm_prefix_cache_hits_total"):
        assert {dict(k)["model"] for k in after[name]} == {"worker", "prefill", "decode"}
    e2e = delta("llm_e2e_request_latency_seconds_sum")
    assert 0 < e2e <= result.token_times[-1] - result.start + 0.05  # within the client's
    by_priority = after["llm_num_requests_running_by_priority"]
    assert {dict(k)["priority"] for k in by_priority} >= {"0"}
    observed = metric_sum(after, f"{ttft}_sum") - metric_sum(before, f"{ttft}_sum")
    assert 0 < observed <= result.ttft + 0.05  # server-side TTFT within the client's
    assert any(k for k in after[f"{ttft}_bucket"] if ("le", "0.5") in k)


def test_dashboard_queries_only_metrics_the_server_exports(server: Server) -> None:
    from tests.deploy.test_dashboard import AUTOSCALER_PREFIX, GATEWAY_PREFIX, dashboard_uses

    used, missing = dashboard_uses(server.metrics(), exclude=(AUTOSCALER_PREFIX, GATEWAY_PREFIX))
    assert used and not missing, missing



def test_keda_queries_use_only_metrics_the_server_exports(server: Server) -> None:
    from tests.deploy.test_dashboard import metric_family
    from tests.deploy.test_kubernetes import documents, keda_queries, query_metrics

    exported = {metric_family(name) for name in server.metrics()}
    used = set().union(*(query_metrics(q) for q in keda_queries(documents())))
    assert used and used <= exported, used - exported
