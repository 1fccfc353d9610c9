"""The server's own latency histograms agree with what aiperf, an independent client, measures
for the same requests (the sweep benchmark prints the same comparison at scale)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from python_backends.bench.aiperf import Target, find_aiperf, profile
from python_backends.config import PROJECT_ROOT
from python_backends.metrics_text import histogram_mean, metric_delta
from tests.e2e.conftest import ENGINE_DIR, Gateway, Server

pytestmark = pytest.mark.e2e

REQUESTS, CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 2, 64, 16
MODEL = "smollm2"  # what the session's gateway serves


def _aiperf() -> str:
    aiperf = find_aiperf()
    if aiperf is None:
        if os.environ.get("CI"):
            pytest.fail("aiperf missing in CI: scripts/test.sh installs it in .venv-aiperf")
        pytest.skip("aiperf not installed: scripts/test.sh installs it in .venv-aiperf")
    return aiperf


def test_server_latencies_agree_with_aiperf(server: Server, tmp_path: Path) -> None:
    aiperf = _aiperf()
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


def test_aiperf_sends_the_chat_dataset_to_the_gateways_chat_endpoint(
        server: Server, gateway: Gateway, tmp_path: Path) -> None:
    """What `bench_sweep.py --dataset chat` runs: the chat prompts as aiperf's single_turn file,
    greedy through /v1/chat/completions, each answer ending at the end token or the limit."""
    rows = [json.loads(line) for line in
            (PROJECT_ROOT / "scripts" / "data" / "chat-prompts.jsonl").read_text().splitlines()]
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"text": r["prompt"]}) + "\n" for r in rows[:6]))
    before = server.metrics()
    result = profile(_aiperf(), Target.openai(gateway.url, MODEL, "chat", ignore_eos=False,
                                              greedy=True),
                     concurrency=2, requests=6, prompt_tokens=0, output_tokens=OUTPUT_TOKENS,
                     tokenizer=ENGINE_DIR, artifacts=tmp_path / "artifacts", timeout_s=600,
                     prompts=prompts)
    after = server.metrics()
    assert result["request_count"]["avg"] == 6
    assert 0 < result["output_sequence_length"]["avg"] <= OUTPUT_TOKENS
    assert metric_delta(before, after, "llm_e2e_request_latency_seconds_count") == 6
    # The prompts reached the server whole: more prompt tokens than the chat template alone.
    assert metric_delta(before, after, "llm_prompt_tokens_total") > 6 * 40
