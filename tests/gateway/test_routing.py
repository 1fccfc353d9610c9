"""Least-loaded routing on recorded server views."""

from __future__ import annotations

from python_backends.gateway.routing import LeastLoaded, ServerView


def _view(name: str, **kw: float | bool | int) -> ServerView:
    base: dict[str, object] = {"region": "eu", "weight": 1.0, "healthy": True}
    return ServerView(name=name, **{**base, **kw})  # type: ignore[arg-type]


def test_the_least_loaded_healthy_server_comes_first() -> None:
    views = [_view("a", running=6, waiting=2), _view("b", running=3),
             _view("c", healthy=False), _view("d", running=3, kv_usage=0.9)]
    assert [v.name for v in LeastLoaded().rank(views)] == ["b", "a", "d"]


def test_weight_divides_load() -> None:
    views = [_view("small", running=4), _view("big", running=6, weight=2.0)]
    assert LeastLoaded().rank(views)[0].name == "big"


def test_the_gateways_own_count_covers_what_metrics_have_not_shown_yet() -> None:
    views = [_view("a", in_flight=5), _view("b", running=2)]
    assert LeastLoaded().rank(views)[0].name == "b"


def test_no_healthy_server_ranks_nothing() -> None:
    assert LeastLoaded().rank([_view("a", healthy=False)]) == []
