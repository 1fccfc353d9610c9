"""A cluster on loopback: a front server, two prefill servers and two decode servers, each its
own tritonserver (python_backends.ops.cluster, as scripts/serve_cluster.sh starts them). The front
calls the engine servers over gRPC; the KV crosses from prefill to decode servers over NIXL.

In order (each test leaves the cluster as the next expects): the reference prompts equal
Hugging Face's through the cluster, with the prefill work on both prefill servers and no prompt
computed on decode; a client that goes away ends its request on the decode server; a prefill
server killed under load costs no request and leaves no KV block
held; a decode server killed under load moves its streams to the other decode server, which
finishes them as Hugging Face would; the last decode server killed under load ends every stream
with a clear error within seconds.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from python_backends.bench.client import GenerateError, LLMClient, as_list
from python_backends.metrics_text import metric_sum, scrape
from python_backends.ops.cluster import Cluster, ClusterPlan
from python_backends.ops.launcher import TritonServer, free_port
from tests.e2e.conftest import (
    ENGINE_DIR,
    MAX_TOKENS,
    PROMPTS,
    Reference,
    hf_greedy,
    wait_metric,
    wait_no_kv_blocks,
)

pytestmark = pytest.mark.e2e
DISAGGREGATED = {"route": "disaggregated", "exclude_input_in_output": True}
# Long, distinct prompts (no prefix shared): about 1200 tokens each, so that a prefill
# server's 4 of them take several engine steps (2048 tokens a step) and finish one by one.
STORIES = [f"Story {i}: " + " ".join(f"On day {d} fisher {i} sailed out to sea."
                                     for d in range(120)) for i in range(8)]
STORY_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("cluster")
    cluster = Cluster(ClusterPlan(prefill=2, decode=2, engine_dir=ENGINE_DIR, log_dir=log_dir)
                      .servers(ports=free_port))
    cluster.start(timeout_s=900)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> LLMClient:
    return LLMClient(cluster.front.options.http_url, timeout=120)


@pytest.fixture(scope="module")
def stories() -> Reference:
    return hf_greedy(STORIES, STORY_TOKENS)


def _metric(server: TritonServer, name: str, **labels: str) -> float:
    return metric_sum(scrape(server.options.metrics_url), name, **labels)


def _wait_no_blocks(servers: list[TritonServer], timeout_s: float = 40.0) -> float:
    """KV blocks still used on `servers` once they are idle (a lease from a dead server's
    handoff is held until its deadline, 30 s)."""
    return wait_no_kv_blocks([s.options.metrics_url for s in servers], timeout_s)


def _kill(server: TritonServer) -> None:
    """The whole server at once, tritonserver and its stubs, as a lost machine would go."""
    assert server.process is not None
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


def test_reference_prompts_cross_servers(cluster: Cluster, client: LLMClient,
                                         reference: Reference) -> None:
    decodes = cluster.of_role("decode")
    prefills = cluster.of_role("prefill")

    def on_decode(name: str, **labels: str) -> float:
        return sum(_metric(d, name, **labels) for d in decodes)

    nixl_before = on_decode("llm_kv_transfer_bytes_total", transport="nixl")
    computed_before = on_decode("llm_prompt_tokens_computed_total")
    for prompt in PROMPTS:
        out = client.generate(prompt, max_tokens=MAX_TOKENS, **DISAGGREGATED)
        assert as_list(out["output_ids"]) == reference.outputs[prompt]
        assert out["text_output"] == reference.text(prompt)
        streamed = client.stream_collect(prompt, max_tokens=MAX_TOKENS, **DISAGGREGATED)
        assert streamed.output_ids == reference.outputs[prompt]
        assert streamed.text == reference.text(prompt)
    moved = on_decode("llm_kv_transfer_bytes_total", transport="nixl") - nixl_before
    served = [_metric(p, "nv_inference_request_success", model="prefill") for p in prefills]
    print(f"KV over NIXL into the decode servers: {moved / 1e6:.2f} MB; prefill requests per "
          f"server: {served}")
    assert moved > 0
    assert on_decode("llm_prompt_tokens_computed_total") == computed_before
    assert all(n > 0 for n in served) and sum(served) == 2 * len(PROMPTS)
    assert all(_metric(d, "nv_inference_request_success", model="decode") > 0 for d in decodes)
    assert on_decode("llm_kv_transfer_failures_total") == 0
    assert _wait_no_blocks([*decodes, *prefills]) == 0


def test_a_client_that_goes_away_ends_its_request_on_the_engine_server(
        cluster: Cluster, client: LLMClient) -> None:
    """No cancel board crosses servers: the front cancels the engine call's gRPC stream."""
    decodes = cluster.of_role("decode")
    body: dict[str, Any] = {"text_input": STORIES[0], "max_tokens": 400, "stream": True,
                            "end_id": -1, **DISAGGREGATED}
    with requests.post(f"{client.base_url}/v2/models/ensemble/generate_stream", json=body,
                       stream=True, timeout=120) as r:
        events = (line for line in r.iter_lines() if line.startswith(b"data:"))
        for _ in range(5):
            next(events)
        assert wait_metric([d.options.metrics_url for d in decodes],
                           "llm_num_requests_running", 1) == 1
    gone_at = time.monotonic()  # the connection is closed here
    while sum(_metric(d, "llm_num_requests_running") for d in decodes) and (
            time.monotonic() - gone_at < 10):
        time.sleep(0.1)
    print(f"the decode server let go of the request {time.monotonic() - gone_at:.1f} s after "
          "its client left")
    assert _wait_no_blocks(decodes, timeout_s=10) == 0
    assert sum(_metric(d, "llm_num_requests_running") for d in decodes) == 0


def test_a_prefill_server_killed_under_load_costs_no_request(
        cluster: Cluster, client: LLMClient, stories: Reference) -> None:
    victim, survivor = cluster.of_role("prefill")
    decodes = cluster.of_role("decode")

    def one(prompt: str) -> list[int]:
        return client.stream_collect(prompt, max_tokens=STORY_TOKENS, **DISAGGREGATED).output_ids

    front = cluster.front
    lost_before = _metric(front, "llm_request_migrations_total")
    computed = "llm_prompt_tokens_computed_total"
    with ThreadPoolExecutor(len(STORIES)) as pool:
        results = [pool.submit(one, p) for p in STORIES]
        # Killed once it has computed its first step of prompt tokens (a 2048-token step, so
        # its other prompts are still to compute), or answered its first prompt, whichever is
        # seen first: waiting for an answer alone sometimes found all its prompts answered.
        answered = _metric(victim, "nv_inference_request_success", model="prefill")
        started = _metric(victim, computed, model="prefill")
        deadline = time.monotonic() + 120
        while (_metric(victim, "nv_inference_request_success", model="prefill") == answered
               and _metric(victim, computed, model="prefill") == started
               and time.monotonic() < deadline):
            time.sleep(0.05)
        _kill(victim)
        outputs = [r.result(timeout=180) for r in results]
    assert outputs == [stories.outputs[p] for p in STORIES]
    lost = _metric(front, "llm_request_migrations_total") - lost_before
    failed = sum(_metric(d, "llm_kv_transfer_failures_total") for d in decodes)
    print(f"prefill calls lost with the server: {lost:.0f}; KV pulls that failed on decode: "
          f"{failed:.0f}")
    assert lost > 0  # the kill did cut prefills in flight
    after = client.generate(STORIES[0], max_tokens=STORY_TOKENS, **DISAGGREGATED)
    assert as_list(after["output_ids"]) == stories.outputs[STORIES[0]]
    assert _wait_no_blocks([*decodes, survivor]) == 0


def test_a_decode_server_killed_under_load_moves_its_streams_to_the_other(
        cluster: Cluster, client: LLMClient, stories: Reference) -> None:
    victim, survivor = cluster.of_role("decode")
    prompts = STORIES[:4]

    def one(prompt: str) -> list[int]:
        return client.stream_collect(prompt, max_tokens=STORY_TOKENS, **DISAGGREGATED).output_ids

    # A moved stream's prompt and tokens so far are computed again on the survivor, which
    # otherwise computes no prompt token (the KV comes from prefill).
    computed_before = _metric(survivor, "llm_prompt_tokens_computed_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = [pool.submit(one, p) for p in prompts]
        deadline = time.monotonic() + 120  # killed while it streams
        while not _metric(victim, "llm_num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.05)
        _kill(victim)
        outputs = [r.result(timeout=180) for r in results]
    assert outputs == [stories.outputs[p] for p in prompts]
    recomputed = _metric(survivor, "llm_prompt_tokens_computed_total") - computed_before
    print(f"tokens the surviving decode server computed for the streams it took over: "
          f"{recomputed:.0f}")
    assert recomputed > 0
    assert _wait_no_blocks([survivor]) == 0


def test_the_last_decode_server_killed_under_load_ends_every_stream_clearly(
        cluster: Cluster, client: LLMClient) -> None:
    decode = cluster.of_role("decode")[1]  # the other one died in the test before
    ended: list[tuple[float, str]] = []

    def one(prompt: str) -> None:
        try:
            client.stream_collect(prompt, max_tokens=400, **DISAGGREGATED)
            ended.append((time.monotonic(), "finished"))
        except GenerateError as e:
            ended.append((time.monotonic(), str(e)))

    with ThreadPoolExecutor(4) as pool:
        for prompt in STORIES[:4]:
            pool.submit(one, prompt)
        deadline = time.monotonic() + 60
        while _metric(decode, "llm_num_requests_running") < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        killed_at = time.monotonic()
        _kill(decode)
    waits = [t - killed_at for t, _ in ended]
    print(f"streams ended {max(waits):.1f} s after the decode server died at most: "
          f"{ended[0][1]}")
    assert len(ended) == 4 and all("no engine instance is left" in why for _, why in ended)
    assert max(waits) < 10

