"""Custom metrics on Triton's metrics port (pb_utils.MetricFamily), Prometheus-named.

Labels identify the model and instance, never the request.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import triton_python_backend_utils as pb_utils

from python_backends.front.stream import RequestStream
from python_backends.wire import DEFAULT_TENANT, FRONT_START_METRIC

if TYPE_CHECKING:  # the front's stub loads this module and needs no torch
    from python_backends.engine.llm_engine import EngineStats, LLMEngine, TokenEvent
    from python_backends.kv_store.host_store import StoreStats

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length")
ROUTES = ("aggregated", "disaggregated", "disaggregated_fallback")
MIGRATION_REASONS = ("engine_died", "engine_unavailable", "instance_down")

PUBLISH_INTERVAL_S = 0.05
# A gauge is sent when its value changed, and every gauge at least this often (a reloaded
# instance's predecessor may have zeroed the shared series as it retired).
REPUBLISH_INTERVAL_S = 1.0
# Counters published from an engine's running totals (EngineStats field, name, help).
ENGINE_TOTALS = (
    ("num_prompt_tokens_computed", "llm_prompt_tokens_computed_total",
     "Prompt positions this instance computed (prefill work, including recomputes)"),
    ("busy_seconds", "llm_engine_busy_seconds_total",
     "Time the engine spent computing steps (1 - its rate is the idle fraction)"),
    ("num_preemptions", "llm_num_preemptions_total", "Sequences preempted (recomputed later)"),
    ("prefix_cache_queries", "llm_prefix_cache_queries_total",
     "Tokens looked up in the prefix cache when a sequence starts"),
    ("prefix_cache_hits", "llm_prefix_cache_hits_total",
     "Of those, tokens whose KV was found (in the pool or the KV store): not computed"),
    ("kv_store_hits", "llm_kv_store_hits_total",
     "Blocks read from the node's KV store after a miss in the instance's own pool"),
    ("kv_store_misses", "llm_kv_store_misses_total",
     "Blocks the KV store listed but could not give (overwritten meanwhile): computed"),
    ("kv_store_read_bytes", "llm_kv_store_read_bytes_total", "Bytes read from the KV store"),
    ("kv_store_written_bytes", "llm_kv_store_written_bytes_total",
     "Bytes written to the KV store"),
    ("kernel_chunks", "llm_kernel_chunks_total",
     "Chunks of work of the engine's native CPU kernels (rank 0's process)"),
    ("helper_chunks", "llm_idle_helper_chunks_total",
     "Of those, chunks the idle-CPU helper thread computed (its share of the second core)"),
    ("helper_taken_back", "llm_idle_helper_taken_back_total",
     "Chunks the helper had taken and the engine thread took back and computed itself"),
    ("helper_boosted", "llm_idle_helper_boosted_total",
     "Heavy jobs (prompts' projections) the helper computed at normal priority, not idle"),
    ("draft_tokens", "llm_spec_draft_tokens_total",
     "Speculative (prompt-lookup) draft tokens the engine computed"),
    ("draft_tokens_accepted", "llm_spec_accepted_tokens_total",
     "Of those, tokens the model confirmed and kept (accepted / draft: the acceptance rate)"),
)
LATENCY_BUCKETS = [
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
    20.0, 40.0,
]


class EngineMetrics:
    """KV-cache and batch gauges of one engine instance."""

    def __init__(self, model: str, instance: str) -> None:
        labels = {"model": model, "instance": instance}
        g = pb_utils.MetricFamily.GAUGE
        self.blocks_used = _metric("llm_kv_cache_blocks_used", "KV-cache blocks in use", g, labels)
        self.blocks_total = _metric(
            "llm_kv_cache_blocks_total", "KV-cache blocks in the pool", g, labels
        )
        self.usage = _metric(
            "llm_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1)", g, labels
        )
        self.block_size = _metric(
            "llm_kv_block_size_tokens", "Tokens per KV-cache block (a prefix hash covers one)",
            g, labels)
        self.step_tokens = _metric(
            "llm_engine_step_tokens_max", "The most tokens one step computes (the step budget: "
            "max_num_batched_tokens)", g, labels)
        self.running = _metric(
            "llm_num_requests_running", "Sequences in the running batch", g, labels
        )
        self.waiting = _metric(
            "llm_num_requests_waiting", "Sequences waiting to join the running batch", g, labels
        )
        self.healthy = _metric(
            "llm_engine_healthy",
            "1 while every rank of the instance's engine runs, 0 once one died (reload it)",
            g, labels,
        )
        # Which load owns the series: a reloaded instance's successor (same labels) sets it
        # anew when it starts, and the predecessor, finalized after that, leaves them alone.
        self.start_time = _metric(
            "llm_engine_start_time_seconds",
            "When the instance's engine was loaded (Unix time); a reload sets it anew", g, labels)
        self._started_at = time.time()
        self.start_time.set(self._started_at)
        self._totals = {field: _Total(_metric(name, doc, pb_utils.MetricFamily.COUNTER, labels))
                        for field, name, doc in ENGINE_TOTALS}
        self._declare_latencies(labels)
        self._labels = labels
        self._placement: dict[str, Metric] = {}  # by device
        self._step_phases: dict[str, _Total] = {}  # by phase (llm_engine.STEP_PHASES)
        self._publish_lock = threading.Lock()
        self._last_publish = 0.0
        self._priorities_seen: dict[str, set[int]] = {"running": set(), "waiting": set()}
        self._sent: dict[Metric, float] = {}  # gauge -> the value last sent
        self._last_republish = 0.0
        flush()  # the start time is there before Triton finalizes a predecessor (retire)

    def _declare_latencies(self, labels: dict[str, str]) -> None:
        self.queue_time = _metric(
            "llm_request_queue_time_seconds", "Time a sequence waited before its first step",
            pb_utils.MetricFamily.HISTOGRAM, labels, LATENCY_BUCKETS,
        )
        self.prefill_time = _metric(
            "llm_request_prefill_time_seconds",
            "A sequence's first scheduled step to its first token on this instance",
            pb_utils.MetricFamily.HISTOGRAM, labels, LATENCY_BUCKETS,
        )
        self.decode_time = _metric(
            "llm_request_decode_time_seconds",
            "A sequence's first token (or arrival, when handed off) to its last on this instance",
            pb_utils.MetricFamily.HISTOGRAM, labels, LATENCY_BUCKETS,
        )

    def observe(self, ev: TokenEvent) -> None:
        """A token event's latencies (loop thread)."""
        if ev.queue_time is not None:
            self.queue_time.observe(ev.queue_time)
        if ev.prefill_time is not None:
            self.prefill_time.observe(ev.prefill_time)
        if ev.decode_time is not None:
            self.decode_time.observe(ev.decode_time)

    def publish_throttled(self, engine: LLMEngine) -> None:
        """After an engine step (loop thread): publish at most every PUBLISH_INTERVAL_S, and
        whenever the engine is idle."""
        now = time.monotonic()
        if now - self._last_publish >= PUBLISH_INTERVAL_S or not engine.has_unfinished:
            self._last_publish = now
            self.publish(engine.stats())

    def retire(self) -> None:
        """The instance is going away (shutdown or a resize): zero its gauges. Triton 2.51 keeps
        a finalized stub's series on the metrics port, so they must not show a stale load.
        Unless a successor (a reload of the same model, which Triton finalizes the old version
        after) has started meanwhile: the series are its own then, and zeroing them would show
        it empty and unhealthy until its next publish."""
        with self._publish_lock:
            try:
                if self.start_time.value() != self._started_at:
                    return
            except MetricsStalled:
                log.error("metrics: tritonserver does not answer; the gauges stay as they are")
                return
            for gauge in (self.blocks_used, self.blocks_total, self.usage, self.running,
                          self.waiting, self.healthy, *self._placement.values()):
                gauge.set(0)
            for state, seen in self._priorities_seen.items():
                for priority in seen:
                    self._by_priority(state, priority).set(0)
            self._sent.clear()
        flush()  # before the stub exits

    def _by_priority(self, state: str, priority: int) -> Metric:
        return _metric(
            f"llm_num_requests_{state}_by_priority", f"Sequences {state}, per priority",
            pb_utils.MetricFamily.GAUGE, {**self._labels, "priority": str(priority)},
        )

    def publish(self, stats: EngineStats) -> None:
        with self._publish_lock:  # the loop thread, and the stub's thread at start and finalize
            self._publish(stats)

    def _publish(self, stats: EngineStats) -> None:
        # Each set is an exchange with tritonserver that holds the stub's GIL (Triton 2.51's
        # pb_utils releases it for increments and observations only): unchanged gauges wait
        # for the periodic republish.
        now = time.monotonic()
        if now - self._last_republish >= REPUBLISH_INTERVAL_S:
            self._last_republish = now
            self._sent.clear()
        gauges: list[tuple[Metric, float]] = [
            (self.blocks_used, stats.kv_blocks_used), (self.blocks_total, stats.kv_blocks_total),
            (self.block_size, stats.kv_block_size), (self.step_tokens, stats.step_tokens),
            (self.usage, stats.kv_blocks_used / stats.kv_blocks_total),
            (self.running, stats.num_running), (self.waiting, stats.num_waiting),
            (self.healthy, int(stats.ranks_alive == stats.ranks_total)),
        ]
        for state, counts in (("running", stats.running_by_priority),
                              ("waiting", stats.waiting_by_priority)):
            seen = self._priorities_seen[state]
            seen.update(counts)
            # a class that emptied reads 0, not its last count
            gauges += [(self._by_priority(state, p), counts.get(p, 0)) for p in seen]
        for device, n in Counter(stats.devices).items():
            if device not in self._placement:
                self._placement[device] = _metric(
                    "llm_engine_ranks", "Ranks of the instance's engine on each device",
                    pb_utils.MetricFamily.GAUGE, {**self._labels, "device": device})
            gauges.append((self._placement[device], n))
        for gauge, value in gauges:
            if self._sent.get(gauge) != value:
                self._sent[gauge] = value
                gauge.set(value)
        for field, total in self._totals.items():
            total.publish(getattr(stats, field))
        for phase, seconds in stats.step_seconds:  # every phase from the first publish on
            if phase not in self._step_phases:
                self._step_phases[phase] = _Total(_metric(
                    "llm_engine_step_seconds_total",
                    "Time the engine loop spent in each phase of its steps (where a token's "
                    "time goes; scripts/bench_sweep.py --breakdown)",
                    pb_utils.MetricFamily.COUNTER, {**self._labels, "phase": phase}))
            self._step_phases[phase].publish(seconds)


class _Total:
    """A counter published from a running total the engine keeps: it grows by the total's
    growth since the last publish."""

    def __init__(self, metric: Metric) -> None:
        self.metric = metric
        self.published = 0.0

    def publish(self, total: float) -> None:
        if total > self.published:
            self.metric.increment(total - self.published)
            self.published = total


class KVStoreMetrics:
    """The node's KV store, as its owner (the kv_store model) sees it."""

    def __init__(self, model: str) -> None:
        labels = {"model": model}
        g = pb_utils.MetricFamily.GAUGE
        self.blocks = _metric("llm_kv_store_blocks_total", "Blocks the KV store can hold", g,
                              labels)
        self.used = _metric("llm_kv_store_blocks_used", "Blocks the KV store holds", g, labels)
        self.usage = _metric("llm_kv_store_usage_ratio", "Fraction of the KV store in use (0-1)",
                             g, labels)
        self.evictions = _Total(_metric(
            "llm_kv_store_evictions_total", "Entries the KV store dropped to make room",
            pb_utils.MetricFamily.COUNTER, labels))

    def publish(self, stats: StoreStats) -> None:
        self.blocks.set(stats.num_slots)
        self.used.set(stats.num_ready)
        self.usage.set(stats.usage)
        self.evictions.publish(stats.num_evictions)


TRANSFER_BUCKETS = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
]


class KVTransferMetrics:
    """KV handoff: pulls on the decode side (bytes, latency, failures, recomputes) and leases
    on the prefill side. The series of the given transports exist from the start, at 0."""

    FAILURE_REASONS = ("error", "timeout", "expired", "layout", "unsupported", "in_doubt")

    def __init__(self, model: str, instance: str, transports: list[str] | None = None) -> None:
        self._labels = {"model": model, "instance": instance}
        self.expired_leases = _metric(
            "llm_kv_lease_expired_total",
            "Leased KV blocks freed at their deadline because no decoder released them",
            pb_utils.MetricFamily.COUNTER, self._labels,
        )
        for transport in transports or []:
            self._bytes(transport)
            self._duration(transport)
            self._fallbacks(transport)
            for reason in self.FAILURE_REASONS:
                self._failures(transport, reason)

    def _bytes(self, transport: str) -> Metric:
        return _metric("llm_kv_transfer_bytes_total", "KV-cache bytes pulled from prefill "
                       "instances", pb_utils.MetricFamily.COUNTER,
                       {**self._labels, "transport": transport})

    def _duration(self, transport: str) -> Metric:
        return _metric("llm_kv_transfer_duration_seconds", "Time to pull one request's KV cache",
                       pb_utils.MetricFamily.HISTOGRAM, {**self._labels, "transport": transport},
                       TRANSFER_BUCKETS)

    def _failures(self, transport: str, reason: str) -> Metric:
        return _metric("llm_kv_transfer_failures_total", "KV pulls that failed, by reason",
                       pb_utils.MetricFamily.COUNTER,
                       {**self._labels, "transport": transport, "reason": reason})

    def _fallbacks(self, transport: str) -> Metric:
        return _metric("llm_kv_transfer_fallbacks_total",
                       "Handed-off requests whose prompt the decode instance recomputed",
                       pb_utils.MetricFamily.COUNTER, {**self._labels, "transport": transport})

    def transferred(self, transport: str, nbytes: int, seconds: float) -> None:
        self._bytes(transport).increment(nbytes)
        self._duration(transport).observe(seconds)

    def failed(self, transport: str, reason: str) -> None:
        """A handoff that could not be used; the decode instance recomputes the prompt."""
        self._failures(transport, reason).increment(1)
        self._fallbacks(transport).increment(1)


class RequestMetrics:
    """Client-visible latencies, paths and refusals, observed in the front (the
    front.orchestrator.FlowMetrics it counts)."""

    def __init__(self, model: str, reject_reasons: tuple[str, ...] = ()) -> None:
        self.model = model
        for reason in reject_reasons:  # the default tenant's series exist from the start, at 0
            self._rejected(reason, DEFAULT_TENANT)
        labels = {"model": model}
        h = pb_utils.MetricFamily.HISTOGRAM
        self.ttft = _metric(
            "llm_time_to_first_token_seconds", "Time from arrival to first token", h, labels,
            LATENCY_BUCKETS,
        )
        self.tpot = _metric(
            "llm_time_per_output_token_seconds",
            "Mean time per output token after the first, per request", h, labels,
            LATENCY_BUCKETS,
        )
        self.e2e = _metric(
            "llm_e2e_request_latency_seconds", "Arrival at the front to the last token", h,
            labels, LATENCY_BUCKETS,
        )
        # A new value means a new front: requests its predecessor held are lost inside Triton
        # (2.51 never ends a dead stub's requests), and the gateway moves them elsewhere.
        _metric(FRONT_START_METRIC, "When this server's front instance started (Unix time)",
                pb_utils.MetricFamily.GAUGE, labels).set(time.time())
        c = pb_utils.MetricFamily.COUNTER
        self.prompt_tokens = _metric(
            "llm_prompt_tokens_total", "Prompt tokens of finished requests", c, labels
        )
        self.generation_tokens = _metric(
            "llm_generation_tokens_total", "Tokens generated for finished requests", c, labels
        )
        self.unserved_requests = _metric(
            "llm_requests_unserved_total", "Requests failed because the engine serving them "
            "failed and no engine instance was left to continue on", c, labels)
        self._labels = labels
        for reason in FINISH_REASONS:  # series exist from the start, at 0
            self._finished(reason)
        for route in ROUTES:
            self._routed(route)
        for reason in MIGRATION_REASONS:
            self._migrated(reason)
        flush()  # the series and the start time are on the metrics port once the front is up

    def finished(self, state: RequestStream) -> None:
        """A request that ended with a finish reason (stop, length)."""
        if state.ttft is not None:
            self.ttft.observe(state.ttft)
        if state.tpot is not None:
            self.tpot.observe(state.tpot)
        if state.last_token_time is not None:
            self.e2e.observe(state.last_token_time - state.arrival_time)
        self.prompt_tokens.increment(len(state.prompt_ids))
        self.generation_tokens.increment(len(state.output_ids))
        self._finished(state.finish_reason).increment(1)
        flush()  # counted before the answer goes out (bounded: see _Writer)

    def _finished(self, reason: str) -> Metric:
        return _metric("llm_requests_finished_total", "Finished requests, by finish reason",
                       pb_utils.MetricFamily.COUNTER, {**self._labels, "finish_reason": reason})

    def _routed(self, route: str) -> Metric:
        return _metric("llm_requests_routed_total", "Requests by serving path (aggregated, "
                       "disaggregated, or disaggregated falling back after a prefill error)",
                       pb_utils.MetricFamily.COUNTER, {**self._labels, "route": route})

    def routed(self, route: str) -> None:
        self._routed(route).increment(1)

    def _migrated(self, reason: str) -> Metric:
        return _metric("llm_request_migrations_total", "Requests moved to another engine "
                       "instance, by why their engine was lost (front.migration)",
                       pb_utils.MetricFamily.COUNTER, {**self._labels, "reason": reason})

    def migrated(self, reason: str) -> None:
        self._migrated(reason).increment(1)

    def unserved(self) -> None:
        self.unserved_requests.increment(1)
        flush()  # like a finish: counted before the error goes out

    def _rejected(self, reason: str, tenant: str) -> Metric:
        return _metric(
            "llm_requests_rejected_total", "Requests refused by admission control",
            pb_utils.MetricFamily.COUNTER,
            {"model": self.model, "reason": reason, "tenant": tenant},
        )

    def rejected(self, reason: str, tenant: str) -> None:
        self._rejected(reason, tenant).increment(1)
        flush()  # like a finish: counted before the error goes out


def _immortal(obj: object) -> None:
    """Hold one reference to `obj` that is never given back: it is not destroyed, not even when
    the stub's interpreter shuts down."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


# Every metric family and metric this stub made, kept for the life of the process and beyond:
# a metric object destroyed in a stub deletes its series in tritonserver, and a series is
# shared by every stub that made one with the same name and labels. Triton 2.51 counts the
# references per stub, so the first stub to let go frees the series while the others still
# write to it: a reloaded instance's predecessor (same instance name, same labels) destroying
# its metrics as it exits after the new one started leaves the new one writing to freed memory
# in tritonserver. Shown with two models and one label set: once one deleted its metric and
# family, the series left the metrics port and the other's updates went nowhere
# (docs/platform.md). So nothing is ever deleted; a retired instance zeroes its gauges instead
# (EngineMetrics.retire).
_families: dict[str, Any] = {}
_metrics: dict[tuple[str, frozenset[tuple[str, str]]], Metric] = {}
_immortal(_families)
_immortal(_metrics)
_lock = threading.Lock()  # _metrics


class MetricsStalled(TimeoutError):
    """tritonserver did not answer a metric call of this stub in time."""


class _Writer:
    """The one thread of a stub that makes pb_utils metric calls, in the order they were asked.

    The calls are not thread-safe (concurrent updates from request threads corrupted the message
    the server reads and crashed tritonserver, seen with 10 concurrent requests), and each is a
    synchronous exchange with tritonserver that can stall: seen once for good after another
    stub of the server was killed, with every request thread that touched a metric waiting
    behind it. So request threads and the engine loop only queue their updates here; a caller
    that needs its updates applied (a finished request counted before its answer goes out)
    waits a bounded time (`flush`), and not at all once the call in progress has already
    overrun that bound. A stalled writer loses no update while its queue has room; beyond
    MAX_PENDING updates are dropped, and counted in the log."""

    MAX_PENDING = 100_000

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: deque[Callable[[], None]] = deque()
        self._queued = 0  # calls ever queued
        self._done = 0  # of those, calls made (or failed)
        self._busy_since: float | None = None  # when the call in progress started
        self._dropped = 0
        self._pid = 0  # the process the thread runs in (a fork has none)

    def submit(self, call: Callable[[], None]) -> int:
        """Queue `call`; the number to `wait` for."""
        with self._cond:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="metrics-writer", daemon=True).start()
            if len(self._pending) >= self.MAX_PENDING:
                self._dropped += 1
                if self._dropped in (1, 1000) or self._dropped % 100_000 == 0:
                    log.error("metrics: tritonserver has not answered a metric call for %.0f s; "
                              "%d updates dropped so far",
                              self._stalled_for(time.monotonic()), self._dropped)
                return self._queued
            self._pending.append(call)
            self._queued += 1
            self._cond.notify_all()
            return self._queued

    def wait(self, ticket: int, timeout: float) -> bool:
        """Whether the calls up to `ticket` were made within `timeout` s. Returns at once when the
        call in progress has run longer than `timeout` already: a stalled writer costs each
        caller at most one bound, not one per update."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._done < ticket:
                now = time.monotonic()
                if now >= deadline or self._stalled_for(now) > timeout:
                    return False
                self._cond.wait(deadline - now)
            return True

    def flush(self, timeout: float) -> bool:
        with self._cond:
            ticket = self._queued
        return self.wait(ticket, timeout)

    def _stalled_for(self, now: float) -> float:
        return 0.0 if self._busy_since is None else now - self._busy_since

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                call = self._pending.popleft()
                self._busy_since = time.monotonic()
            try:
                call()
            except Exception:
                log.exception("metrics: a metric call failed")
            with self._cond:
                self._busy_since = None
                self._done += 1
                self._cond.notify_all()


_writer = _Writer()
# How long a caller waits for its updates to reach tritonserver (they normally take well under
# a millisecond); and for a value read back.
FLUSH_TIMEOUT_S = 1.0
READ_TIMEOUT_S = 5.0


def flush(timeout: float = FLUSH_TIMEOUT_S) -> bool:
    """Wait, at most `timeout` s, until this stub's metric updates so far reached tritonserver;
    whether they did."""
    return _writer.flush(timeout)


class Metric:
    """A pb_utils metric of this stub, made and updated by the stub's metrics writer."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._metric: Any = None

        def create() -> None:
            self._metric = make()
        _writer.submit(create)

    def set(self, value: float) -> None:
        _writer.submit(lambda: self._metric.set(value))

    def increment(self, value: float = 1.0) -> None:
        _writer.submit(lambda: self._metric.increment(value))

    def observe(self, value: float) -> None:
        _writer.submit(lambda: self._metric.observe(value))

    def value(self) -> float:
        """The series' value, as every stub that shares it last left it (after this stub's own
        updates so far); MetricsStalled when tritonserver does not answer in time."""
        got: list[float] = []
        failed: list[Exception] = []

        def read() -> None:
            try:
                got.append(float(self._metric.value()))
            except Exception as e:  # raised to the caller, not logged by the writer
                failed.append(e)
        if not _writer.wait(_writer.submit(read), READ_TIMEOUT_S):
            raise MetricsStalled(f"no metric value in {READ_TIMEOUT_S:.0f} s")
        if failed:
            raise failed[0]
        if not got:  # dropped: the queue is full behind a stalled call
            raise MetricsStalled("the metrics writer's queue is full")
        return got[0]


def _metric(
    name: str, doc: str, kind: Any, labels: dict[str, str], buckets: list[float] | None = None
) -> Metric:
    """The metric of this family and label set, created on first use."""
    key = (name, frozenset(labels.items()))
    with _lock:
        metric = _metrics.get(key)
        if metric is None:
            def make() -> Any:  # on the writer thread, like every pb_utils metric call
                family = _families.get(name)
                if family is None:
                    family = _families[name] = pb_utils.MetricFamily(
                        name=name, description=doc, kind=kind)
                if buckets is not None:
                    return family.Metric(labels=labels, buckets=buckets)
                return family.Metric(labels=labels)
            metric = _metrics[key] = Metric(make)
        return metric
