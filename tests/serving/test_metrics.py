"""Metric objects outlive the stub that made them (pb_utils faked at the edge, in a process of
its own so that its interpreter's shutdown can be watched)."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest

from python_backends.config import PROJECT_ROOT
from python_backends.engine.llm_engine import EngineStats

# A stub's life in miniature: a fake pb_utils whose metric objects say when they are destroyed
# (a real one then deletes the series in tritonserver), an engine's metrics made and used, the
# references dropped, then the interpreter's normal shutdown.
STUB = textwrap.dedent("""
    import gc, sys, types

    class _Object:
        def __init__(self, *args, **kwargs):
            self.args = args
            self.kwargs = kwargs

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

        def __del__(self):
            print("destroyed", type(self).__name__, flush=True)

    class MetricFamily(_Object):
        COUNTER, GAUGE, HISTOGRAM = 0, 1, 2

        def Metric(self, *args, **kwargs):
            return FakeMetric(*args, **kwargs)

    class FakeMetric(_Object):
        pass

    pb = types.ModuleType("triton_python_backend_utils")
    pb.MetricFamily = MetricFamily
    sys.modules["triton_python_backend_utils"] = pb

    from python_backends.serving.metrics import EngineMetrics
    metrics = EngineMetrics("worker", "worker_0_0")
    metrics.blocks_used.set(3)
    metrics.queue_time.observe(0.1)
    import python_backends.serving.metrics as module
    assert module.flush(), "the writer made the calls"
    del metrics, module
    gc.collect()
    print("exiting", flush=True)
""")


def test_no_metric_object_is_destroyed_even_when_the_stub_exits() -> None:
    out = subprocess.run([sys.executable, "-c", STUB], cwd=PROJECT_ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "exiting" in out
    assert "destroyed" not in out, out


class _Series:
    """One prometheus series: shared by every stub that makes a metric with its family name
    and labels, as in tritonserver."""

    def __init__(self) -> None:
        self.current = 0.0

    def set(self, value: float) -> None:
        self.current = value

    def increment(self, value: float = 1.0) -> None:
        self.current += value

    def observe(self, value: float) -> None:
        pass

    def value(self) -> float:
        return self.current


def _stub(series: dict[tuple[str, frozenset[tuple[str, str]]], _Series],
          new_series: Callable[[str], _Series] = lambda family: _Series()) -> Any:
    """`serving.metrics` as one more stub process would load it: a module of its own (its own
    metric objects) over the server's shared series, each new one made by `new_series` from
    its family's name."""
    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = 0, 1, 2

        def __init__(self, name: str, description: str, kind: int) -> None:
            self.name = name

        def Metric(self, labels: dict[str, str], buckets: Any = None) -> _Series:
            key = (self.name, frozenset(labels.items()))
            if key not in series:
                series[key] = new_series(self.name)
            return series[key]

    pb = types.ModuleType("triton_python_backend_utils")
    pb.MetricFamily = MetricFamily  # type: ignore[attr-defined]
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = pb
    try:
        spec = importlib.util.spec_from_file_location(
            f"stub_metrics_{len(series)}", PROJECT_ROOT / "python_backends/serving/metrics.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["triton_python_backend_utils"]
        else:
            sys.modules["triton_python_backend_utils"] = saved
    return module


def _stats(**kw: Any) -> EngineStats:
    return EngineStats(**{
        "kv_blocks_used": 3, "kv_blocks_total": 8, "kv_block_size": 16, "step_tokens": 2048,
        "num_running": 1, "num_waiting": 0, "num_preemptions": 0,
        "num_prompt_tokens_computed": 0, "busy_seconds": 0.0, "running_by_priority": {0: 1},
        "waiting_by_priority": {}, **kw})


def test_a_reloaded_instance_keeps_its_gauges_when_its_predecessor_retires() -> None:
    series: dict[tuple[str, frozenset[tuple[str, str]]], _Series] = {}

    def gauge(name: str, **extra: str) -> float:
        labels = {"model": "worker", "instance": "worker_0_0", **extra}
        return series[(name, frozenset(labels.items()))].current

    old = _stub(series).EngineMetrics("worker", "worker_0_0")
    old.publish(_stats())
    new_stub = _stub(series)
    new = new_stub.EngineMetrics("worker", "worker_0_0")  # Triton: loaded, then old retired
    new.publish(_stats())
    assert new_stub.flush()
    old.retire()
    assert gauge("llm_engine_healthy") == 1
    assert gauge("llm_kv_cache_blocks_used") == 3
    new.retire()  # the last owner: nothing left to serve
    assert gauge("llm_engine_healthy") == 0
    assert gauge("llm_kv_cache_blocks_used") == 0
    assert gauge("llm_num_requests_running_by_priority", priority="0") == 0


def test_an_instance_unloaded_for_good_zeroes_its_gauges() -> None:
    series: dict[tuple[str, frozenset[tuple[str, str]]], _Series] = {}
    metrics = _stub(series).EngineMetrics("worker", "worker_0_1")  # removed by a resize
    metrics.publish(_stats())
    metrics.retire()
    for (name, labels), s in series.items():
        if name.startswith(("llm_kv_cache_blocks", "llm_num_requests", "llm_engine_healthy")):
            assert s.current == 0, (name, dict(labels))


class _StuckSeries(_Series):
    """A series whose calls wait until `release` is set: tritonserver not answering."""

    def __init__(self, release: threading.Event, calls: list[tuple[str, float, int]]) -> None:
        super().__init__()
        self.release, self.calls = release, calls

    def increment(self, value: float = 1.0) -> None:
        self.calls.append(("increment", value, threading.get_ident()))
        self.release.wait(60)
        super().increment(value)

    def set(self, value: float) -> None:
        self.calls.append(("set", value, threading.get_ident()))
        super().set(value)


def test_a_metric_call_that_does_not_return_holds_no_caller_beyond_the_flush_bound() -> None:
    release = threading.Event()
    calls: list[tuple[str, float, int]] = []
    module = _stub({}, lambda family: _StuckSeries(release, calls))
    counter = module._metric("llm_test_total", "test", module.pb_utils.MetricFamily.COUNTER, {})
    gauge = module._metric("llm_test", "test", module.pb_utils.MetricFamily.GAUGE, {})
    try:
        start = time.monotonic()
        counter.increment(2)  # the writer's call hangs in it
        for i in range(100):
            gauge.set(i)  # queued behind it
        assert time.monotonic() - start < 0.5, "updates only queue"
        assert not module.flush(0.3), "the writer is stuck"
        start = time.monotonic()
        assert not module.flush(0.2)
        assert time.monotonic() - start < 0.1, "a stall older than the bound costs no wait"
        with pytest.raises(module.MetricsStalled):
            module.READ_TIMEOUT_S = 0.2
            counter.value()
    finally:
        release.set()
    assert module.flush(10)
    assert counter.value() == 2 and gauge.value() == 99, "nothing lost, in the order asked"
    assert [c[:2] for c in calls] == [("increment", 2)] + [("set", i) for i in range(100)]
    assert len({c[2] for c in calls}) == 1, "one thread makes every call"
    assert calls[0][2] != threading.get_ident()


def test_a_stalled_writer_drops_updates_beyond_its_queue_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    calls: list[tuple[str, float, int]] = []
    module = _stub({}, lambda family: _StuckSeries(release, calls))
    module._writer.MAX_PENDING = 10
    counter = module._metric("llm_test_total", "test", module.pb_utils.MetricFamily.COUNTER, {})
    try:
        counter.increment()
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:  # the writer is in that call
            time.sleep(0.01)
        with caplog.at_level(logging.ERROR):
            for _ in range(30):
                counter.increment()
        assert "1 updates dropped" in caplog.text
    finally:
        release.set()
    assert module.flush(10)
    assert counter.value() == 1 + 10, "the call in progress and a full queue"


def test_unchanged_gauges_wait_for_the_periodic_republish() -> None:
    sets: list[tuple[str, float]] = []

    class CountingSeries(_Series):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def set(self, value: float) -> None:
            sets.append((self.name, value))
            super().set(value)

    module = _stub({}, CountingSeries)
    metrics = module.EngineMetrics("worker", "worker_0_0")
    metrics.publish(_stats())
    assert module.flush()
    first = [name for name, _ in sets if name != "llm_engine_start_time_seconds"]
    assert "llm_kv_cache_blocks_used" in first and "llm_engine_healthy" in first
    sets.clear()
    metrics.publish(_stats())
    metrics.publish(_stats(kv_blocks_used=5))
    assert module.flush()
    assert sets == [("llm_kv_cache_blocks_used", 5), ("llm_kv_cache_usage_ratio", 5 / 8)]
    sets.clear()
    metrics._last_republish -= module.REPUBLISH_INTERVAL_S
    metrics.publish(_stats(kv_blocks_used=5))
    assert module.flush()
    assert sorted(name for name, _ in sets) == sorted(first), "every gauge again"


def test_a_value_that_cannot_be_read_raises_in_the_caller() -> None:
    class Unreadable(_Series):
        def value(self) -> float:
            raise RuntimeError("metric was deleted")

    module = _stub({}, lambda family: Unreadable())
    gauge = module._metric("llm_test", "test", module.pb_utils.MetricFamily.GAUGE, {})
    with pytest.raises(RuntimeError, match="deleted"):
        gauge.value()
    gauge.set(1)
    assert module.flush(), "the writer goes on"


class _SlowSeries(_Series):
    """tritonserver answering slowly, but answering."""

    def increment(self, value: float = 1.0) -> None:
        time.sleep(0.02)
        super().increment(value)


@pytest.mark.parametrize("outcome", ["finished", "rejected", "unserved"])
def test_how_a_request_ended_is_counted_before_the_caller_goes_on(outcome: str) -> None:
    from python_backends.front.stream import RequestStream

    series: dict[tuple[str, frozenset[tuple[str, str]]], _Series] = {}
    module = _stub(series, lambda family: _SlowSeries())
    metrics = module.RequestMetrics("front", reject_reasons=("queue_full",))
    state = RequestStream(prompt_ids=[1, 2, 3], stream=True, exclude_input_in_output=True,
                          return_log_probs=False, output_ids=[7, 8], finish_reason="stop")
    {"finished": lambda: metrics.finished(state),
     "rejected": lambda: metrics.rejected("queue_full", "default"),
     "unserved": metrics.unserved}[outcome]()

    def total(name: str, **labels: str) -> float:
        return series[(name, frozenset({"model": "front", **labels}.items()))].current
    counted = {
        "finished": lambda: (total("llm_requests_finished_total", finish_reason="stop"),
                             total("llm_generation_tokens_total")) == (1, 2),
        "rejected": lambda: total("llm_requests_rejected_total", reason="queue_full",
                                  tenant="default") == 1,
        "unserved": lambda: total("llm_requests_unserved_total") == 1,
    }[outcome]()
    assert counted
