"""Routing policies on recorded server views: least-loaded, prefix-aware (Dynamo's trade-off),
latency-aware spill-over, a sticky canary share, residency pinning, and their chain."""

from __future__ import annotations

from typing import Any

import pytest

from python_backends.gateway.config import GatewayConfig
from python_backends.gateway.routing import (
    Canary,
    LatencyAware,
    LeastLoaded,
    PrefixAware,
    Residency,
    RouteRequest,
    ServerView,
    prefix_hashes,
)
from python_backends.gateway.service import build_policy

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
    turn1 = RouteRequest("t", prefix=prefix_hashes(system + [100] * 16, 16, "tenant:t"))
    turn2 = RouteRequest("t", prefix=prefix_hashes(system + [200] * 16, 16, "tenant:t"))
    views = [_view("a", kv_blocks_used=2), _view("b", kv_blocks_used=0)]
    first = policy.rank(views, turn1)[0].name
    assert first == "b"  # nothing cached anywhere: the emptier server
    policy.record(first, turn1)
    assert policy.overlap("b", turn2.prefix) == 4
    # b now holds 3 blocks more than a, but a would compute 4 more of the prompt's 5 blocks
    views = [_view("a", kv_blocks_used=2), _view("b", kv_blocks_used=5)]
    assert policy.rank(views, turn2)[0].name == "b"
    # enough decode load outweighs the cached prefix
    views = [_view("a", kv_blocks_used=2), _view("b", kv_blocks_used=50)]
    assert policy.rank(views, turn2)[0].name == "a"


def test_prefix_hashes_are_chained_and_salted() -> None:
    ids = list(range(40))
    assert len(prefix_hashes(ids, 16, "s")) == 2  # full blocks only
    assert prefix_hashes(ids, 16, "s")[0] != prefix_hashes(ids, 16, "other")[0]
    changed = [99, *ids[1:]]
    assert prefix_hashes(changed, 16, "s")[1] != prefix_hashes(ids, 16, "s")[1]  # chained


def test_the_prefix_index_is_bounded() -> None:
    policy = PrefixAware(max_blocks=3)
    policy.record("a", RouteRequest("t", prefix=(1, 2, 3, 4, 5)))
    assert policy.overlap("a", (3, 4, 5)) == 3 and policy.overlap("a", (1,)) == 0


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
