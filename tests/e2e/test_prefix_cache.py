"""Prefix caching through the running server: a repeated prompt computes only its uncached
rest on every path, with the same output; tenants do not share cached KV unless configured to;
the kv_store model serves a prefix one worker instance computed to another."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp
import pytest

from python_backends.bench.client import as_list
from python_backends.config import EngineConfig
from python_backends.engine.sequence import Sequence
from python_backends.front.tenancy import CacheSharing
from python_backends.gateway.backends import Backend
from python_backends.gateway.config import BackendConfig
from python_backends.gateway.routing import RouteRequest, ServerView
from python_backends.metrics_text import metric_sum
from python_backends.params import SamplingParams
from tests.e2e.conftest import ENGINE_DIR, MAX_TOKENS, PROMPTS, Reference, Server

pytestmark = pytest.mark.e2e
GREEDY = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
# About 110 tokens: six full blocks of the default engine's 16.
SYSTEM = ("You are a helpful assistant for a bakery in Brittany. You answer questions about "
          "opening hours, the crêpes and galettes on the menu, allergens, prices and orders. "
          "Be brief and friendly, and never invent a dish that is not on the menu. ") * 2


class Counters:
    """Metric deltas around a block of requests."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.before = server.metrics()
        self.after: dict[str, Any] = {}

    def __enter__(self) -> Counters:
        return self

    def __exit__(self, *exc: object) -> None:
        # An engine publishes its counters after a step, at most every 0.05 s
        # (serving/metrics.py): the last step's may land just after the client has its answer.
        # Read until they settle.
        def ours(metrics: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in metrics.items() if k.startswith("llm_")}

        self.after = self.server.metrics()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            time.sleep(0.15)
            again = self.server.metrics()
            settled = ours(again) == ours(self.after)
            self.after = again
            if settled:
                break

    def delta(self, name: str, **labels: str) -> float:
        return metric_sum(self.after, name, **labels) - metric_sum(self.before, name, **labels)


@pytest.mark.parametrize("route", ["aggregated", "disaggregated"])
def test_a_repeated_prompt_is_served_from_the_cache(
    server: Server, reference: Reference, route: str
) -> None:
    prompt, salt = PROMPTS[0], uuid.uuid4().hex
    text = SYSTEM + prompt
    n_prompt = len(reference.tokenizer(text)["input_ids"])
    group = "worker" if route == "aggregated" else "prefill"
    with Counters(server) as cold:
        first = server.client.generate(text, route=route, cache_salt=salt, **GREEDY)
    assert cold.delta("llm_prefix_cache_hits_total", model=group) == 0
    assert cold.delta("llm_prompt_tokens_computed_total", model=group) == n_prompt
    with Counters(server) as warm:
        second = server.client.generate(text, route=route, cache_salt=salt, **GREEDY)
    assert as_list(second["output_ids"]) == as_list(first["output_ids"])
    cached = (n_prompt - 1) // 16 * 16
    assert warm.delta("llm_prefix_cache_hits_total", model=group) == cached
    assert warm.delta("llm_prefix_cache_queries_total", model=group) == n_prompt
    assert warm.delta("llm_prompt_tokens_computed_total", model=group) == n_prompt - cached
    if route == "disaggregated":  # the handoff still carried the whole prompt's KV
        assert warm.delta("llm_prompt_tokens_computed_total", model="decode") == 0
        assert warm.delta("llm_kv_transfer_fallbacks_total") == 0
    assert server.wait_idle() == 0


def test_tenants_do_not_share_cached_prefixes(server: Server) -> None:
    a, b = f"iso-a-{uuid.uuid4().hex[:8]}", f"iso-b-{uuid.uuid4().hex[:8]}"
    text = SYSTEM + "What is on the menu today?"
    server.client.generate(text, route="aggregated", tenant=a, **GREEDY)
    with Counters(server) as other:
        server.client.generate(text, route="aggregated", tenant=b, **GREEDY)
    assert other.delta("llm_prefix_cache_hits_total") == 0
    with Counters(server) as same:
        server.client.generate(text, route="aggregated", tenant=a, **GREEDY)
    assert same.delta("llm_prefix_cache_hits_total") > 0


def test_tenants_configured_to_share_do(server: Server) -> None:
    a, b = f"share-a-{uuid.uuid4().hex[:8]}", f"share-b-{uuid.uuid4().hex[:8]}"
    text = SYSTEM + "Do you have gluten-free galettes?"
    repo = server.options.repository()
    with repo.reloaded("front", prefix_cache_shared_tenants=f"{a},{b}"):
        server.client.generate(text, route="aggregated", tenant=a, **GREEDY)
        with Counters(server) as shared:
            server.client.generate(text, route="aggregated", tenant=b, **GREEDY)
    assert shared.delta("llm_prefix_cache_hits_total") > 0


def test_the_gateway_hashes_prompts_as_the_servers_engines_do(server: Server) -> None:
    """The gateway's prefix-aware routing reads from the server how its engines key cached KV
    (the block size they publish, the front's tenant sharing), and reads it again when the
    front reloads with another configuration."""
    a, b = f"gw-a-{uuid.uuid4().hex[:8]}", f"gw-b-{uuid.uuid4().hex[:8]}"
    backend = Backend(BackendConfig(name="s", grpc=server.options.grpc_address,
                                    metrics=server.options.metrics_url))
    repo = server.options.repository()

    async def views() -> tuple[ServerView, ServerView]:
        backend.connect()
        try:
            async with aiohttp.ClientSession() as session:
                await backend.check(session, 10.0, 60.0)
                before = backend.view(time.monotonic(), 60.0)
                with repo.reloaded("front", prefix_cache_shared_tenants=f"{a},{b}"):
                    await backend.check(session, 10.0, 60.0)
                    return before, backend.view(time.monotonic(), 60.0)
        finally:
            await backend.client.close()

    before, shared = asyncio.run(views())
    block_size = EngineConfig.load(ENGINE_DIR).limits.block_size
    assert before.block_size == shared.block_size == block_size
    assert before.cache_sharing == CacheSharing()
    assert shared.cache_sharing == CacheSharing(frozenset({a, b}))
    prompt = list(range(3 * block_size + 5))
    engine = Sequence("s", prompt, SamplingParams(max_tokens=1),
                      cache_salt=shared.cache_sharing.salt(a)).block_hashes(block_size, 3)
    routed = RouteRequest(b, token_ids=tuple(prompt)).prefix(block_size, shared.cache_sharing)
    assert list(routed) == engine  # b's prompt is found where a's was cached


def test_a_prefix_one_worker_instance_computed_is_read_by_another(server: Server) -> None:
    """Two worker instances: the first request is computed by one of them; requests go on
    until the other serves the same prompt, reading the prefix from the kv_store model."""
    repo = server.options.repository()
    text, salt = SYSTEM + "When do you open on Sunday?", uuid.uuid4().hex
    repo.set_instance_count("worker", 2)
    try:
        server.client.generate(text, route="aggregated", cache_salt=salt, **GREEDY)
        computed = "llm_prompt_tokens_computed_total"
        first = server.metrics()
        done_by = {dict(k)["instance"] for k, v in first[computed].items()
                   if dict(k)["model"] == "worker" and v > 0}
        for _ in range(12):  # Triton spreads requests over the instances
            with Counters(server) as c:
                server.client.generate(text, route="aggregated", cache_salt=salt, **GREEDY)
            if c.delta("llm_kv_store_hits_total", model="worker") > 0:
                break
        else:
            pytest.fail(f"no worker instance read the prefix from the store ({done_by})")
        assert c.delta(computed, model="worker") < 16  # only the uncached rest
        assert c.delta("llm_kv_store_read_bytes_total", model="worker") > 0
    finally:
        repo.set_instance_count("worker", 1)
    assert metric_sum(server.metrics(), "llm_kv_store_blocks_used", model="kv_store") > 0
