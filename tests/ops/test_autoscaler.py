"""Autoscaling decisions on a simulated clock and synthetic scrapes."""

from __future__ import annotations

from typing import Any

import pytest

from python_backends.metrics_text import histogram_quantile
from python_backends.ops.autoscaler import Autoscaler, Metrics, Policy

BUCKETS = (0.05, 0.1, 0.2, 0.5, 1.0, float("inf"))


def labels(**kv: str) -> Any:
    return frozenset(kv.items())


class Server:
    """Cumulative metrics of a fake server: feed observations, take scrapes."""

    def __init__(self) -> None:
        self.hist: dict[str, list[float]] = {"llm_time_to_first_token_seconds": [],
                                             "llm_time_per_output_token_seconds": []}
        self.busy: dict[str, float] = {"worker": 0.0, "prefill": 0.0, "decode": 0.0}
        self.prompt_tokens: dict[str, float] = {"worker": 0.0, "prefill": 0.0, "decode": 0.0}
        self.kv: dict[str, float] = {"worker": 0.1, "prefill": 0.1, "decode": 0.1}
        self.waiting: dict[str, float] = {"worker": 0.0, "prefill": 0.0, "decode": 0.0}

    def scrape(self) -> Metrics:
        m: Metrics = {}
        for name, values in self.hist.items():
            m[f"{name}_bucket"] = {
                labels(model="front", le=("+Inf" if le == float("inf") else str(le))):
                    float(sum(v <= le for v in values)) for le in BUCKETS
            }
        for group in self.busy:
            inst = labels(model=group, instance=f"{group}_0")
            m.setdefault("llm_engine_busy_seconds_total", {})[inst] = self.busy[group]
            m.setdefault("llm_prompt_tokens_computed_total", {})[inst] = self.prompt_tokens[group]
            m.setdefault("llm_kv_cache_usage_ratio", {})[inst] = self.kv[group]
            m.setdefault("llm_num_requests_waiting", {})[inst] = self.waiting[group]
        return m


POLICY = Policy(window_s=60, scale_up_cooldown_s=60, scale_down_cooldown_s=300,
                bounds={"prefill": (1, 3)})


@pytest.fixture
def setup() -> tuple[Server, Autoscaler, list[float]]:
    now = [0.0]
    return Server(), Autoscaler(POLICY, clock=lambda: now[0]), now


def run(server: Server, scaler: Autoscaler, now: list[float], seconds: int,
        load: dict[str, Any] | None = None, step: int = 10) -> None:
    for _ in range(seconds // step):
        now[0] += step
        if load:
            server.hist["llm_time_to_first_token_seconds"] += [load.get("ttft", 0.05)] * 5
            server.hist["llm_time_per_output_token_seconds"] += [load.get("tpot", 0.02)] * 5
            for group in load.get("groups", ()):
                server.busy[group] += step * 0.9
                server.prompt_tokens[group] += 100
        scaler.observe(server.scrape())


def test_quantile_from_bucket_deltas() -> None:
    s = Server()
    before = s.scrape()
    s.hist["llm_time_to_first_token_seconds"] += [0.03] * 90 + [0.7] * 10
    after = s.scrape()
    p50 = histogram_quantile(0.5, before, after, "llm_time_to_first_token_seconds")
    p95 = histogram_quantile(0.95, before, after, "llm_time_to_first_token_seconds")
    assert p50 is not None and p50 <= 0.05
    assert p95 is not None and 0.5 < p95 <= 1.0
    assert histogram_quantile(0.95, after, after, "llm_time_to_first_token_seconds") is None


def test_slow_ttft_adds_a_prefill_instance_then_cooldown_holds(setup: Any) -> None:
    server, scaler, now = setup
    counts = {"worker": 1, "prefill": 1, "decode": 1}
    run(server, scaler, now, 60, {"ttft": 0.7, "groups": ("prefill", "decode")})
    [d] = scaler.decide(counts)
    assert (d.group, d.current, d.target, d.direction) == ("prefill", 1, 2, "up")
    assert "TTFT p95" in d.reason
    scaler.changed("prefill")
    counts["prefill"] = 2
    run(server, scaler, now, 30, {"ttft": 0.7, "groups": ("prefill", "decode")})
    assert scaler.decide(counts) == []  # cooldown
    run(server, scaler, now, 40, {"ttft": 0.7, "groups": ("prefill", "decode")})
    [d] = scaler.decide(counts)
    assert d.target == 3
    scaler.changed("prefill")
    counts["prefill"] = 3
    run(server, scaler, now, 70, {"ttft": 0.7, "groups": ("prefill", "decode")})
    assert scaler.decide(counts) == []  # at the group's maximum


def test_ttft_scales_the_worker_when_no_prefill_traffic(setup: Any) -> None:
    server, scaler, now = setup
    run(server, scaler, now, 60, {"ttft": 0.7, "groups": ("worker",)})
    decisions = {d.group: d for d in scaler.decide({"worker": 1, "prefill": 1, "decode": 1})}
    assert decisions["worker"].direction == "up"


def test_slow_tpot_adds_decode_and_full_kv_adds_to_that_pool(setup: Any) -> None:
    server, scaler, now = setup
    server.kv["worker"] = 0.9
    run(server, scaler, now, 60, {"tpot": 0.2, "groups": ("prefill", "decode", "worker")})
    decisions = {d.group: d for d in scaler.decide({"worker": 1, "prefill": 1, "decode": 1})}
    assert decisions["decode"].direction == "up" and "TPOT" in decisions["decode"].reason
    assert decisions["worker"].direction == "up" and "KV usage" in decisions["worker"].reason
    assert "prefill" not in decisions  # TTFT is fine


def test_idle_groups_shrink_after_the_cooldown_but_not_below_min(setup: Any) -> None:
    server, scaler, now = setup
    counts = {"worker": 1, "prefill": 2, "decode": 1}
    scaler.changed("prefill")
    run(server, scaler, now, 120)  # no load at all
    assert scaler.decide(counts) == []  # within the scale-down cooldown
    run(server, scaler, now, 200)
    [d] = scaler.decide(counts)
    assert (d.group, d.target, d.direction) == ("prefill", 1, "down")
    assert "idle" in d.reason
    server.waiting["prefill"] = 3
    run(server, scaler, now, 60)
    assert scaler.decide(counts) == []  # a queue blocks shrinking


def test_no_decision_without_enough_history(setup: Any) -> None:
    server, scaler, now = setup
    run(server, scaler, now, 20, {"ttft": 0.9, "groups": ("prefill",)})
    assert scaler.decide({"prefill": 1}) == []
