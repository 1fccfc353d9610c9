"""python_backends.metrics_text: reading a Prometheus scrape."""

from __future__ import annotations

from python_backends.metrics_text import histogram_quantile, parse_metrics

SCRAPE = """\
# HELP nv_inference_count Number of inferences
# TYPE nv_inference_count counter
nv_inference_count{model="front",version="1"} 12
llm_num_requests_waiting{model="front"} 3
llm_num_requests_waiting_tokens{model="front"} 40
llm_ttft_seconds_bucket{le="0.5"} 2
llm_ttft_seconds_bucket{le="+Inf"} 4
llm_ttft_seconds_sum 3.5
llm_ttft_seconds_count 4
"""


def test_a_scrape_is_read_by_name_and_labels() -> None:
    m = parse_metrics(SCRAPE)
    assert m["nv_inference_count"] == {frozenset({("model", "front"), ("version", "1")}): 12.0}
    assert m["llm_ttft_seconds_count"] == {frozenset(): 4.0}


def test_only_the_families_asked_for_are_read() -> None:
    m = parse_metrics(SCRAPE, only=("llm_num_requests_waiting", "llm_ttft_seconds"))
    assert "nv_inference_count" not in m
    # a prefix: a histogram comes whole, and a longer name that starts alike comes too
    assert set(m) == {"llm_num_requests_waiting", "llm_num_requests_waiting_tokens",
                      "llm_ttft_seconds_bucket", "llm_ttft_seconds_sum",
                      "llm_ttft_seconds_count"}
    assert histogram_quantile(0.5, {}, m, "llm_ttft_seconds") == 0.5
