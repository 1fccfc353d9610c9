"""A small client for the `ensemble` over Triton's HTTP generate endpoints and metrics port.

Used by the end-to-end tests and the benchmark; any Triton client works the same way.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import requests

from python_backends.wire import FINISH_ERROR


class GenerateError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass
class StreamResult:
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    start: float = field(default_factory=time.monotonic)
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


class LLMClient:
    def __init__(self, base_url: str, model: str = "ensemble", timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self._local = threading.local()

    @property
    def session(self) -> requests.Session:
        """One connection pool per thread: a shared Session is not thread-safe."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _url(self, endpoint: str) -> str:
        return f"{self.base_url}/v2/models/{self.model}/{endpoint}"

    def generate(self, text: str | None, **inputs: Any) -> dict[str, Any]:
        """One non-streaming request; raises GenerateError with Triton's message on failure."""
        body = dict(inputs) if text is None else {"text_input": text, **inputs}
        r = self.session.post(self._url("generate"), data=json.dumps(body), timeout=self.timeout)
        payload = r.json()
        if r.status_code != 200 or "error" in payload:
            raise GenerateError(r.status_code, payload.get("error", r.text))
        return dict(payload)

    def stream(self, text: str, **inputs: Any) -> Generator[dict[str, Any], None, None]:
        """Server-sent events of a streaming request, one dict per response."""
        body = {"text_input": text, "stream": True, **inputs}
        with self.session.post(self._url("generate_stream"), data=json.dumps(body),
                               stream=True, timeout=self.timeout) as r:
            if r.status_code != 200:
                raise GenerateError(r.status_code, r.text)
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:  # Triton's error event: a failure before the first chunk
                    raise GenerateError(400, event["error"])
                if event.get("finish_reason") == FINISH_ERROR:  # a failure after it
                    raise GenerateError(r.status_code, event.get("error_message", ""))
                yield event

    def stream_collect(self, text: str, **inputs: Any) -> StreamResult:
        result = StreamResult()
        for event in self.stream(text, **inputs):
            now = time.monotonic()
            ids = as_list(event.get("output_ids", []))
            result.token_times.extend([now] * len(ids))
            result.output_ids.extend(ids)
            result.text += event.get("text_output", "")
            result.finish_reason = event.get("finish_reason", "")
            result.num_input_tokens = event.get("num_input_tokens", 0)
            result.num_output_tokens = event.get("num_output_tokens", 0)
        return result


def as_list(value: Any) -> list[Any]:
    """Triton's JSON writes a one-element tensor as a bare value."""
    return value if isinstance(value, list) else [value]


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


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linearly interpolated; NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


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
