import pytest

from python_backends.front.routing import DisaggregationPolicy, Route, Router
from python_backends.front.validation import InvalidRequest


def test_auto_disaggregates_long_prompts_while_prefill_has_room() -> None:
    router = Router(DisaggregationPolicy(disaggregation=True, min_prompt_tokens=100,
                                  max_inflight_prefills=2))
    assert router.choose("auto", 99) is Route.AGGREGATED
    assert router.choose("auto", 100) is Route.DISAGGREGATED
    assert router.choose("auto", 500) is Route.DISAGGREGATED
    assert router.inflight_prefills == 2
    assert router.choose("auto", 500) is Route.AGGREGATED  # prefill group saturated
    assert router.choose("disaggregated", 5) is Route.DISAGGREGATED  # forcing ignores both
    router.prefill_done()
    router.prefill_done()
    router.prefill_done()
    assert router.choose("auto", 500) is Route.DISAGGREGATED


def test_forced_routes_and_missing_groups() -> None:
    agg_only = Router(DisaggregationPolicy(disaggregation=False))
    assert agg_only.choose("auto", 10_000) is Route.AGGREGATED
    with pytest.raises(InvalidRequest) as e:
        agg_only.choose("disaggregated", 10)
    assert e.value.field == "route"
    disagg_only = Router(DisaggregationPolicy(disaggregation=True, aggregation=False))
    assert disagg_only.choose("auto", 1) is Route.DISAGGREGATED
    with pytest.raises(InvalidRequest):
        disagg_only.choose("aggregated", 10)
    assert Router(DisaggregationPolicy(disaggregation=True)).choose("aggregated", 10_000) is (
        Route.AGGREGATED)
    with pytest.raises(ValueError):
        DisaggregationPolicy(disaggregation=False, aggregation=False)


def test_without_auto_only_a_forced_route_disaggregates() -> None:
    router = Router(DisaggregationPolicy(disaggregation=True, min_prompt_tokens=1, auto=False))
    assert router.choose("auto", 10_000) is Route.AGGREGATED
    assert router.inflight_prefills == 0
    assert router.choose("disaggregated", 5) is Route.DISAGGREGATED
    only = Router(DisaggregationPolicy(disaggregation=True, aggregation=False, auto=False))
    assert only.choose("auto", 5) is Route.DISAGGREGATED  # the one path there is
