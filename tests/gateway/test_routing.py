"""Routing policies on recorded server views: least-loaded, prefix-aware (Dynamo's trade-off),
latency-aware spill-over, a sticky canary share, residency pinning, and their chain."""

from __future__ import annotations

from typing import Any

import pytest

from python_backends.engine.sequence import Sequence
from python_backends.front.tenancy import CacheSharing
from python_backends.gateway.config import GatewayConfig
from python_backends.gateway.routing import (
    Canary,
    LatencyAware,
    LeastLoaded,
    PrefixAware,
    Residency,
    RouteRequest,
    ServerView,
)
from python_backends.gateway.service import build_policy
from python_backends.params import SamplingParams

REQ = RouteRequest(tenant="t")


def _view(name: str, **kw: Any) -> ServerView:
    return ServerView(name=name, **{"region": "eu", "weight": 1.0, "healthy": True, **kw})


def _names(views: list[ServerView]) -> list[str]:
    return [v.name for v in views]


def test_the_least_loaded_healthy_server_comes_first() -> None:
    views = [_view("a", running=6, waiting=2), _view("b", running=3),
             _view("c", healthy=False), _view("d", running=3, kv_usage=0.9)]
    assert _names(LeastLoaded().rank(views, REQ)) == ["b", "a", "d"]


def test_weight_divides_load() -> None:
    views = [_view("small", running=4), _view("big", running=6, weight=2.0)]
    assert LeastLoaded().rank(views, REQ)[0].name == "big"


def test_the_gateways_own_count_covers_what_metrics_have_not_shown_yet() -> None:
    views = [_view("a", in_flight=5), _view("b", running=2)]
    assert LeastLoaded().rank(views, REQ)[0].name == "b"


def test_no_healthy_server_ranks_nothing() -> None:
    assert LeastLoaded().rank([_view("a", healthy=False)], REQ) == []


def test_prefix_aware_sends_a_shared_prefix_back_to_the_server_that_has_it() -> None:
    policy = PrefixAware(overlap_weight=1.0)
    system = list(range(64))  # a 64-token system prompt: 4 blocks of 16
    turn1 = RouteRequest("t", token_ids=(*system, *[100] * 16))
    turn2 = RouteRequest("t", token_ids=(*system, *[200] * 16))
    views = [_view("a", kv_blocks_used=2), _view("b", kv_blocks_used=0)]
    first = policy.rank(views, turn1)[0].name
    assert first == "b"  # nothing cached anywhere: the emptier server
    policy.record(first, turn1)
    assert policy.overlap("b", turn2.prefix(16, CacheSharing())) == 4
    # b now holds 3 blocks more than a, but a would compute 4 more of the prompt's 5 blocks
    views = [_view("a", kv_blocks_used=2), _view("b", kv_blocks_used=5)]
    assert policy.rank(views, turn2)[0].name == "b"
    # enough decode load outweighs the cached prefix
    views = [_view("a", kv_blocks_used=2), _view("b", kv_blocks_used=50)]
    assert policy.rank(views, turn2)[0].name == "a"


def test_prompts_are_hashed_as_each_servers_engines_key_their_blocks() -> None:
    ids = tuple(range(64))
    seq = Sequence("s", list(ids), SamplingParams(max_tokens=1), cache_salt="tenant:t")
    engine_16 = seq.block_hashes(16, 4)
    req = RouteRequest("t", token_ids=ids)
    assert list(req.prefix(16, CacheSharing())) == engine_16  # the engine's own hashes
    assert len(req.prefix(32, CacheSharing())) == 2  # another server's block size
    shared = req.prefix(16, CacheSharing.parse("t"))
    assert shared[0] != engine_16[0]  # a front that shares t's cache salts it otherwise
    salted = RouteRequest("t", token_ids=ids, cache_salt="mine").prefix(16, CacheSharing())
    assert salted[0] not in engine_16


def test_each_server_is_scored_with_its_own_block_size() -> None:
    policy = PrefixAware(overlap_weight=1.0)
    prompt = RouteRequest("t", token_ids=tuple(range(64)))
    views = [_view("a", block_size=16), _view("b", block_size=32)]
    policy.rank(views, prompt)
    policy.record("b", prompt)
    assert policy.overlap("b", prompt.prefix(32, CacheSharing())) == 2
    assert policy.overlap("b", prompt.prefix(16, CacheSharing())) == 0


def test_a_server_without_a_block_size_gets_the_configured_one() -> None:
    policy = PrefixAware(default_block_size=8)
    prompt = RouteRequest("t", token_ids=tuple(range(64)))
    policy.rank([_view("a")], prompt)
    policy.record("a", prompt)
    assert policy.overlap("a", prompt.prefix(8, CacheSharing())) == 8


def test_the_prefix_index_is_bounded() -> None:
    policy = PrefixAware(max_blocks=3, default_block_size=1)
    policy.record("a", RouteRequest("t", token_ids=(1, 2, 3, 4, 5)))
    prefix = RouteRequest("t", token_ids=(1, 2, 3, 4, 5)).prefix(1, CacheSharing())
    assert policy.overlap("a", prefix[2:]) == 3 and policy.overlap("a", prefix[:1]) == 0


def test_latency_aware_prefers_the_clients_region_and_spills_over() -> None:
    policy = LatencyAware(LeastLoaded(), bound_s=0.2)
    views = [_view("us-1", region="us", running=0), _view("eu-1", region="eu", running=5,
                                                          ttft_p95_s=0.1)]
    eu_client = RouteRequest("t", region="eu")
    assert _names(policy.rank(views, eu_client)) == ["eu-1", "us-1"]
    slow = [views[0], _view("eu-1", region="eu", running=5, ttft_p95_s=0.5)]
    assert _names(policy.rank(slow, eu_client)) == ["us-1", "eu-1"]  # over the bound
    assert _names(policy.rank(views, RouteRequest("t"))) == ["us-1", "eu-1"]  # region unknown


def test_a_canary_gets_its_share_sticky_per_user() -> None:
    policy = Canary(LeastLoaded(), fraction=0.1)
    views = [_view("stable", running=5), _view("canary", canary=True)]
    firsts = [policy.rank(views, RouteRequest("t", user=f"user-{i}"))[0].name
              for i in range(1000)]
    share = firsts.count("canary") / len(firsts)
    assert 0.07 <= share <= 0.13, share
    again = [policy.rank(views, RouteRequest("t", user=f"user-{i}"))[0].name
             for i in range(1000)]
    assert again == firsts  # sticky
    # users outside the canary never see it while a stable server is healthy
    outside = next(i for i, f in enumerate(firsts) if f == "stable")
    assert _names(policy.rank(views, RouteRequest("t", user=f"user-{outside}"))) == ["stable"]


def test_residency_never_serves_a_pinned_tenant_outside_its_regions() -> None:
    policy = Residency(LeastLoaded(), {"eu-bank": frozenset({"eu"})})
    views = [_view("eu-1", region="eu", running=9), _view("us-1", region="us")]
    assert _names(policy.rank(views, RouteRequest("eu-bank"))) == ["eu-1"]
    assert _names(policy.rank(views, RouteRequest("anyone"))) == ["us-1", "eu-1"]
    down = [_view("eu-1", region="eu", healthy=False), _view("us-1", region="us")]
    assert policy.rank(down, RouteRequest("eu-bank")) == []


@pytest.mark.parametrize("routing", [
    {"policy": "prefix_aware", "latency_bound_s": 0.2, "canary_fraction": 0.1,
     "residency": {"eu-bank": ["eu"]}},
])
def test_the_configured_chain(routing: dict[str, Any]) -> None:
    config = GatewayConfig.from_dict({"backends": [
        {"name": "eu-1", "grpc": "h:1", "metrics": "u", "region": "eu"},
        {"name": "us-1", "grpc": "h:2", "metrics": "u", "region": "us", "canary": True}],
        "routing": routing})
    policy = build_policy(config)
    assert isinstance(policy, Residency) and isinstance(policy.inner, Canary)
    assert isinstance(policy.inner.inner, LatencyAware)
    assert isinstance(policy.inner.inner.inner, PrefixAware)
    views = [_view("eu-1", region="eu"), _view("us-1", region="us", canary=True)]
    assert _names(policy.rank(views, RouteRequest("eu-bank", user="x"))) == ["eu-1"]
