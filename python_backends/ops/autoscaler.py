"""Autoscaling from the serving metrics: the decisions (pure, on a given clock) and the actuator
(Triton's model-repository API). `scripts/autoscaler.py` runs them against a live server.

Signals, over a sliding window of metric snapshots (histogram P95s from bucket deltas, not
lifetime averages): TTFT P95 above its threshold adds a prefill instance (a worker instance when
no prefill traffic went through the window), TPOT P95 adds a decode instance (else worker), KV
usage above its threshold adds an instance to the group whose pool is full, and a group with an
empty queue whose instances sat idle more than a fraction of the window loses one. Counts stay
within per-group bounds; a group changes at most once per cooldown (a longer one to shrink).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from python_backends.metrics_text import (
    Metrics,
    histogram_quantile,
    label_match,
    metric_delta,
    metric_sum,
    scrape,
)
from python_backends.ops.repository import TritonRepository

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    """Thresholds (the usual production rules as defaults), window and cooldowns."""

    ttft_p95_s: float = 0.2
    tpot_p95_s: float = 0.05
    kv_usage: float = 0.8
    idle_fraction: float = 0.3
    window_s: float = 60.0
    scale_up_cooldown_s: float = 60.0
    scale_down_cooldown_s: float = 300.0
    min_instances: int = 1
    max_instances: int = 4
    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)  # group -> (min, max)

    def limits(self, group: str) -> tuple[int, int]:
        return self.bounds.get(group, (self.min_instances, self.max_instances))


@dataclass(frozen=True)
class Decision:
    group: str
    current: int
    target: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down"


def gauge_max(m: Metrics, name: str, **labels: str) -> float:
    return max((v for k, v in m.get(name, {}).items() if label_match(k, labels)), default=0.0)


class Autoscaler:
    """Feed it scrapes with `observe`; `decide` says what to change, given the current counts."""

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._window: deque[tuple[float, Metrics]] = deque()
        self._last_change: dict[str, float] = {}

    def observe(self, metrics: Metrics) -> None:
        now = self._clock()
        self._window.append((now, metrics))
        # Keep one snapshot at or before the window's start, as the baseline of the deltas.
        while len(self._window) > 2 and self._window[1][0] <= now - self.policy.window_s:
            self._window.popleft()

    def changed(self, group: str) -> None:
        """Record that `group` was just resized (starts its cooldown)."""
        self._last_change[group] = self._clock()

    def decide(self, counts: dict[str, int]) -> list[Decision]:
        """At most one decision per group. `counts`: current instances of each group served."""
        if len(self._window) < 2:
            return []
        (t0, before), (t1, after) = self._window[0], self._window[-1]
        if t1 - t0 < self.policy.window_s * 0.5:
            return []  # too little history to judge
        p = self.policy
        up: dict[str, str] = {}

        def traffic(group: str) -> bool:
            return metric_delta(before, after, "llm_prompt_tokens_computed_total",
                                 model=group) > 0 or metric_delta(
                before, after, "llm_engine_busy_seconds_total", model=group) > 0

        ttft = histogram_quantile(0.95, before, after, "llm_time_to_first_token_seconds")
        if ttft is not None and ttft > p.ttft_p95_s:
            group = "prefill" if "prefill" in counts and traffic("prefill") else "worker"
            up.setdefault(group, f"TTFT p95 {ttft:.3f} s > {p.ttft_p95_s} s")
        tpot = histogram_quantile(0.95, before, after, "llm_time_per_output_token_seconds")
        if tpot is not None and tpot > p.tpot_p95_s:
            group = "decode" if "decode" in counts and traffic("decode") else "worker"
            up.setdefault(group, f"TPOT p95 {tpot:.3f} s > {p.tpot_p95_s} s")
        for group in counts:
            usage = gauge_max(after, "llm_kv_cache_usage_ratio", model=group)
            if usage > p.kv_usage:
                up.setdefault(group, f"KV usage {usage:.2f} > {p.kv_usage}")
        decisions = []
        for group, n in counts.items():
            lo, hi = p.limits(group)
            since = t1 - self._last_change.get(group, -math.inf)
            if group in up:
                if n < hi and since >= p.scale_up_cooldown_s:
                    decisions.append(Decision(group, n, n + 1, up[group]))
                continue
            waiting = metric_sum(after, "llm_num_requests_waiting", model=group)
            busy = metric_delta(before, after, "llm_engine_busy_seconds_total", model=group)
            idle = 1.0 - busy / ((t1 - t0) * max(n, 1))
            if (n > lo and waiting == 0 and idle > p.idle_fraction
                    and since >= p.scale_down_cooldown_s):
                decisions.append(Decision(group, n, n - 1, f"queue empty, {idle:.0%} idle > "
                                                           f"{p.idle_fraction:.0%}"))
        return decisions


class Controller:
    """One autoscaling loop: scrape, decide, act (unless dry-run), log and count decisions."""

    def __init__(
        self, scaler: Autoscaler, repo: TritonRepository, metrics_url: str,
        dry_run: bool = False, scrape_fn: Callable[[str], Metrics] | None = None,
    ) -> None:
        self.scaler = scaler
        self.repo = repo
        self.metrics_url = metrics_url
        self.dry_run = dry_run
        self._scrape = scrape_fn or scrape
        self.counts: dict[str, int] = {}
        self.decisions: dict[tuple[str, str], int] = {}  # (group, direction) -> count
        self.last: list[Decision] = []

    def refresh_counts(self) -> None:
        self.counts = {g: self.repo.instance_count(g) for g in self.repo.served_groups()}

    def tick(self) -> list[Decision]:
        if not self.counts:
            self.refresh_counts()
        self.scaler.observe(self._scrape(self.metrics_url))
        decisions = self.scaler.decide(self.counts)
        for d in decisions:
            key = (d.group, d.direction)
            self.decisions[key] = self.decisions.get(key, 0) + 1
            verb = "would scale" if self.dry_run else "scaling"
            log.info("%s %s %s: %d -> %d instances (%s)", verb, d.group, d.direction,
                     d.current, d.target, d.reason)
            if self.dry_run:
                continue
            try:
                self.repo.set_instance_count(d.group, d.target)
            except Exception:
                log.exception("resizing %s failed", d.group)
                continue
            self.counts[d.group] = d.target
            self.scaler.changed(d.group)
        self.last = decisions
        return decisions

    def exposition(self) -> str:
        """Prometheus text: decisions and instance counts (the autoscaler's own endpoint)."""
        lines = [
            "# HELP llm_autoscaler_decisions_total Scaling decisions, by group and direction",
            "# TYPE llm_autoscaler_decisions_total counter",
        ]
        for (group, direction), n in sorted(self.decisions.items()):
            lines.append(f'llm_autoscaler_decisions_total{{group="{group}",'
                         f'direction="{direction}"}} {n}')
        lines += ["# HELP llm_autoscaler_instances Instances of each group",
                  "# TYPE llm_autoscaler_instances gauge"]
        lines += [f'llm_autoscaler_instances{{group="{g}"}} {n}'
                  for g, n in sorted(self.counts.items())]
        lines += ["# HELP llm_autoscaler_dry_run 1 when decisions are only logged",
                  "# TYPE llm_autoscaler_dry_run gauge",
                  f"llm_autoscaler_dry_run {int(self.dry_run)}"]
        return "\n".join(lines) + "\n"
