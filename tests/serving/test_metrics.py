"""Metric objects outlive the stub that made them (pb_utils faked at the edge, in a process of
its own so that its interpreter's shutdown can be watched)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from python_backends.config import PROJECT_ROOT

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
    del metrics
    gc.collect()
    print("exiting", flush=True)
""")


def test_no_metric_object_is_destroyed_even_when_the_stub_exits() -> None:
    out = subprocess.run([sys.executable, "-c", STUB], cwd=PROJECT_ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "exiting" in out
    assert "destroyed" not in out, out
