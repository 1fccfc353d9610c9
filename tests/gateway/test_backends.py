"""python_backends.gateway.backends: a server's load and health, from what its scrape says."""

from __future__ import annotations

from python_backends.gateway.backends import READ_METRICS, Backend
from python_backends.gateway.config import BackendConfig
from python_backends.metrics_text import parse_metrics

# A scrape as a server writes it (abridged): Triton's own families, then the project's.
SCRAPE = """\
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="front",version="1"} 90
nv_inference_queue_duration_us{model="worker",version="1"} 1234
llm_engine_healthy{instance="worker_0_0"} 1
llm_kv_cache_usage_ratio{instance="worker_0_0"} 0.25
llm_num_requests_waiting{instance="worker_0_0"} 3
llm_num_requests_running{instance="worker_0_0"} 5
llm_kv_cache_blocks_used{instance="worker_0_0"} 40
llm_time_to_first_token_seconds_bucket{le="0.1"} 1
llm_time_to_first_token_seconds_bucket{le="+Inf"} 2
llm_front_start_time_seconds{instance="front_0_0"} 1700000000
"""


def test_the_families_read_are_all_that_the_view_needs() -> None:
    full, read = parse_metrics(SCRAPE), parse_metrics(SCRAPE, READ_METRICS)
    assert "nv_inference_request_success" not in read
    views = []
    for metrics in (full, read):
        b = Backend(BackendConfig(name="a", grpc="127.0.0.1:1", metrics="http://127.0.0.1:2"))
        b.ready, b.last_answer, b.metrics = True, 100.0, metrics
        views.append(b.view(now=100.0, unhealthy_after_s=5.0))
    assert views[0] == views[1]
    assert (views[1].waiting, views[1].running, views[1].kv_blocks_used) == (3, 5, 40)
    assert views[1].healthy and views[1].kv_usage == 0.25
