"""The server's own latency histograms agree with what aiperf, an independent client, measures
for the same requests (the sweep benchmark prints the same comparison at scale)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from python_backends.bench.aiperf import Target, find_aiperf, profile
from python_backends.metrics_text import histogram_mean, metric_delta
from tests.e2e.conftest import ENGINE_DIR, Server

pytestmark = pytest.mark.e2e

REQUESTS, CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 2, 64, 16


def test_server_latencies_agree_with_aiperf(server: Server, tmp_path: Path) -> None:
    aiperf = find_aiperf()
    if aiperf is None:
        if os.environ.get("CI"):
            pytest.fail("aiperf missing in CI: scripts/test.sh installs it in .venv-aiperf")
        pytest.skip("aiperf not installed: scripts/test.sh installs it in .venv-aiperf")
    assert server.wait_idle() == 0
    before = server.metrics()
    result = profile(aiperf, Target.ours(server.options.http_url, tmp_path),
                     concurrency=CONCURRENCY, requests=REQUESTS, prompt_tokens=PROMPT_TOKENS,
                     output_tokens=OUTPUT_TOKENS, tokenizer=ENGINE_DIR,
                     artifacts=tmp_path / "artifacts", timeout_s=600)
    after = server.metrics()

    assert result["request_count"]["avg"] == REQUESTS
    assert result["output_sequence_length"]["avg"] == OUTPUT_TOKENS
    assert metric_delta(before, after, "llm_e2e_request_latency_seconds_count") == REQUESTS
    assert metric_delta(before, after, "llm_generation_tokens_total") == REQUESTS * OUTPUT_TOKENS
    for ours, theirs in (("llm_time_to_first_token_seconds", "time_to_first_token"),
                         ("llm_time_per_output_token_seconds", "inter_token_latency"),
                         ("llm_e2e_request_latency_seconds", "request_latency")):
        mean = histogram_mean(before, after, ours)
        assert mean is not None, ours
        ratio = 1e3 * mean / result[theirs]["avg"]
        print(f"{ours}: server {1e3 * mean:.1f} ms, aiperf {result[theirs]['avg']:.1f} ms, "
              f"ratio {ratio:.2f}")
        assert 0.8 <= ratio <= 1.2, (ours, ratio)
