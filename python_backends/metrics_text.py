"""Prometheus' text exposition format, read: the scrapes the gateway, the autoscaler, the
benchmarks and the tests take of Triton's metrics port."""

from __future__ import annotations

import math

import requests

Labels = frozenset[tuple[str, str]]
Metrics = dict[str, dict[Labels, float]]  # a scrape: metric name -> labels -> value


def scrape(metrics_url: str) -> dict[str, dict[Labels, float]]:
    """A metrics endpoint's series: {metric name: {labels: value}}."""
    return parse_metrics(requests.get(metrics_url, timeout=10).text)


def parse_metrics(text: str, only: tuple[str, ...] = ()) -> dict[str, dict[Labels, float]]:
    """Prometheus text format -> {metric name: {labels: value}}; with `only`, just the series
    whose names start with one of those (a histogram's name gives its _bucket, _sum and
    _count): a reader of a few families skips the rest of a large scrape cheaply."""
    out: dict[str, dict[Labels, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or (only and not line.startswith(only)):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels: Labels = frozenset(
            (k, v.strip('"')) for k, _, v in
            (kv.partition("=") for kv in rest.rstrip("}").split(",") if kv)
        )
        out.setdefault(name, {})[labels] = float(value)
    return out


def metric_sum(metrics: dict[str, dict[Labels, float]], name: str, **labels: str) -> float:
    """Sum of a metric over the series whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for k, v in metrics.get(name, {}).items() if want <= k)


def metric_delta(
    before: dict[str, dict[Labels, float]], after: dict[str, dict[Labels, float]], name: str,
    **labels: str,
) -> float:
    """How much a counter (summed like `metric_sum`) grew between two scrapes."""
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def histogram_mean(
    before: dict[str, dict[Labels, float]], after: dict[str, dict[Labels, float]], name: str,
    **labels: str,
) -> float | None:
    """Mean of the observations a histogram got between two scrapes; None if it got none."""
    n = metric_delta(before, after, f"{name}_count", **labels)
    return metric_delta(before, after, f"{name}_sum", **labels) / n if n else None


def label_match(labels: Labels, want: dict[str, str]) -> bool:
    return set(want.items()) <= labels


def histogram_quantile(
    q: float, before: Metrics, after: Metrics, name: str, **labels: str
) -> float | None:
    """The q-quantile of the observations between two scrapes (Prometheus' interpolation within
    the bucket); None when nothing was observed."""
    buckets: dict[float, float] = {}
    for m, sign in ((after, 1.0), (before, -1.0)):
        for k, v in m.get(f"{name}_bucket", {}).items():
            if label_match(k, labels):
                le = float(dict(k)["le"])
                buckets[le] = buckets.get(le, 0.0) + sign * v
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    prev_bound, prev_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return prev_bound  # beyond the last finite bucket: its bound is all we know
            width = count - prev_count
            return prev_bound + (le - prev_bound) * ((rank - prev_count) / width if width else 1)
        prev_bound, prev_count = le, count
    return prev_bound
