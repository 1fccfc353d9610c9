"""Disaggregated serving through the running server: prefill and decode groups in their own
stub processes, the KV cache crossing between them over NIXL and host shared memory."""

from __future__ import annotations

import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest

from python_backends.bench.client import GenerateError, as_list
from python_backends.config import EngineConfig
from python_backends.metrics_text import metric_sum
from python_backends.procfs import live_stubs
from tests.e2e.conftest import ENGINE_DIR, MAX_TOKENS, PROMPTS, Reference, Server

pytestmark = pytest.mark.e2e
GREEDY = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
PATHS = [
    {"route": "aggregated"},
    {"route": "disaggregated", "kv_transport": "nixl"},
    {"route": "disaggregated", "kv_transport": "host_shm"},
]


def _label(path: dict[str, str]) -> str:
    return "-".join(path.values())


def _metric(server: Server, name: str, **labels: str) -> float:
    return metric_sum(server.metrics(), name, **labels)


@pytest.mark.parametrize("path", PATHS, ids=_label)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_path_matches_hf(
    server: Server, reference: Reference, prompt: str, path: dict[str, str]
) -> None:
    out = server.client.generate(prompt, **GREEDY, **path)
    assert as_list(out["output_ids"]) == reference.outputs[prompt]
    assert out["text_output"] == reference.text(prompt)
    streamed = server.client.stream_collect(prompt, **GREEDY, **path)
    assert streamed.output_ids == reference.outputs[prompt]
    assert streamed.text == reference.text(prompt)


def _stub_pids(server: Server, model: str) -> set[int]:
    assert server.triton.process is not None
    return {s.pid for s in live_stubs(server.triton.process.pid) if s.model == model}


@pytest.mark.parametrize("transport", ["nixl", "host_shm"])
def test_kv_crosses_processes_and_decode_computes_no_prompt(
    server: Server, reference: Reference, transport: str
) -> None:
    prefill, decode = _stub_pids(server, "prefill"), _stub_pids(server, "decode")
    assert prefill and decode and not prefill & decode
    prompt = PROMPTS[4]
    n_prompt = len(reference.tokenizer(prompt)["input_ids"])
    before = server.metrics()
    out = server.client.generate(prompt, route="disaggregated", kv_transport=transport,
                                 cache_salt=uuid.uuid4().hex, **GREEDY)  # a cold prefix cache
    assert as_list(out["output_ids"]) == reference.outputs[prompt]
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert delta("llm_prompt_tokens_computed_total", model="decode") == 0
    assert delta("llm_prompt_tokens_computed_total", model="prefill") == n_prompt
    config = EngineConfig.load(ENGINE_DIR)
    m = config.model
    block = config.limits.block_size
    expected = math.ceil(n_prompt / block) * block * m.num_layers * 2 * m.num_kv_heads * (
        m.head_dim * 4)
    assert delta("llm_kv_transfer_bytes_total", model="decode", transport=transport) == expected
    assert delta("llm_kv_transfer_duration_seconds_count", transport=transport) == 1
    assert delta("llm_kv_transfer_failures_total") == 0
    assert server.wait_idle() == 0  # the prefill lease was released, decode finished


@pytest.mark.parametrize("fault", ["transfer_error", "expire_lease"])
@pytest.mark.parametrize("transport", ["nixl", "host_shm"])
def test_failed_handoff_recomputes_correctly(
    server: Server, reference: Reference, fault: str, transport: str
) -> None:
    prompt = PROMPTS[1]
    n_prompt = len(reference.tokenizer(prompt)["input_ids"])
    before = server.metrics()
    out = server.client.stream_collect(prompt, route="disaggregated", kv_transport=transport,
                                       kv_fault=fault, cache_salt=uuid.uuid4().hex, **GREEDY)
    assert out.output_ids == reference.outputs[prompt]
    assert server.wait_idle() == 0  # every group: worker, prefill (lease freed) and decode
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    reason = {"transfer_error": "error", "expire_lease": "expired"}[fault]
    assert delta("llm_kv_transfer_failures_total", transport=transport, reason=reason) == 1
    assert delta("llm_kv_transfer_fallbacks_total", transport=transport) == 1
    assert delta("llm_prompt_tokens_computed_total", model="decode") == n_prompt
    if fault == "expire_lease":
        assert delta("llm_kv_lease_expired_total", model="prefill") == 1


def test_16_in_flight_across_paths(server: Server, reference: Reference) -> None:
    work: list[tuple[str, dict[str, Any], bool]] = [
        (PROMPTS[i % len(PROMPTS)], PATHS[i % len(PATHS)], i % 2 == 1) for i in range(16)
    ]

    def one(item: tuple[str, dict[str, Any], bool]) -> list[int]:
        prompt, path, stream = item
        if stream:
            return server.client.stream_collect(prompt, **GREEDY, **path).output_ids
        return as_list(server.client.generate(prompt, **GREEDY, **path)["output_ids"])

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, work))
    for (prompt, path, _), ids in zip(work, results, strict=True):
        assert ids == reference.outputs[prompt], (prompt, path)
    assert server.wait_idle() == 0


def test_auto_route_disaggregates_long_prompts_unless_the_groups_share_the_cpu(
    server: Server, reference: Reference
) -> None:
    """The session's server runs worker, prefill and decode on this machine's CPU: `auto`
    keeps a prompt past disaggregation_min_prompt_tokens (256) on the worker, which computes
    all of it, and `route` still forces the disaggregated path; with the front's
    disaggregation_on_shared_cpu, `auto` disaggregates it, and a short prompt never."""
    long_prompt = "Tell me about the history of France. " * 40
    n_prompt = len(reference.tokenizer(long_prompt)["input_ids"])
    assert n_prompt >= 256
    routed = partial(_metric, server, "llm_requests_routed_total", route="disaggregated")
    before, disaggregated = server.metrics(), routed()
    out = server.client.generate(long_prompt, max_tokens=4, cache_salt=uuid.uuid4().hex)
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert out["num_input_tokens"] == n_prompt and routed() == disaggregated
    assert delta("llm_prompt_tokens_computed_total", model="worker") == n_prompt
    assert delta("llm_prompt_tokens_computed_total", model="prefill") == 0
    server.client.generate(long_prompt, max_tokens=4, route="disaggregated")
    assert routed() == disaggregated + 1
    with server.options.repository().reloaded("front", disaggregation_on_shared_cpu="true"):
        disaggregated = routed()  # (a reloaded front's counters may start again)
        short = server.client.generate(PROMPTS[0], max_tokens=4)
        assert routed() == disaggregated and short["num_output_tokens"] == 4
        server.client.generate(long_prompt, max_tokens=4)
        assert routed() == disaggregated + 1


def test_routing_parameters_are_validated(server: Server) -> None:
    from python_backends.bench.client import GenerateError

    for key, value in (("route", "sideways"), ("kv_transport", "pigeon"), ("kv_fault", "x")):
        with pytest.raises(GenerateError) as e:
            server.client.generate(PROMPTS[0], max_tokens=2, **{key: value})
        assert key in str(e.value)


def test_a_handoff_decode_refuses_gives_the_lease_back_at_once(server: Server) -> None:
    """Decode refuses a prefilled request it can never fit: the client gets the refusal, and
    the prefill instance's lease is released at once, not when it expires (kv_lease_seconds)."""
    prompt = "Tell me about the sea. " * 40  # about 240 tokens: more than 8 blocks of 16
    with server.options.repository().reloaded("decode", kv_cache_blocks="8"):
        expired = _metric(server, "llm_kv_lease_expired_total", model="prefill")
        with pytest.raises(GenerateError) as e:
            server.client.generate(prompt, max_tokens=8, route="disaggregated",
                                   cache_salt=uuid.uuid4().hex)
        assert "KV blocks" in e.value.message and e.value.status == 400
        deadline = time.monotonic() + 3.0
        while _metric(server, "llm_kv_cache_blocks_used", model="prefill") and (
                time.monotonic() < deadline):
            time.sleep(0.1)
        assert _metric(server, "llm_kv_cache_blocks_used", model="prefill") == 0
        assert _metric(server, "llm_kv_lease_expired_total", model="prefill") == expired
