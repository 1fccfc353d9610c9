"""Which path a request takes: the aggregated worker group, or prefill then decode.

Conditional disaggregation (as in Dynamo): a prompt long enough to be worth a remote prefill
goes to the prefill group while that group has room; everything else stays aggregated, where a
short prompt costs less than a handoff. The `route` request parameter forces either path.
Where the groups share one machine's CPU cores (every group local, on CPU instances) a prefill
instance only takes cores from the worker, and `auto` keeps everything aggregated (the front
decides: serving/front.py; docs/disaggregation.md has the figures).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from python_backends.front.validation import InvalidRequest


class Route(enum.Enum):
    AGGREGATED = "aggregated"
    DISAGGREGATED = "disaggregated"


@dataclass(frozen=True)
class DisaggregationPolicy:
    """The paths a front has and when it disaggregates (the gateway's RoutingPolicy chooses a
    server; this chooses a path inside one)."""

    disaggregation: bool  # prefill and decode groups are configured
    aggregation: bool = True  # a worker group is configured
    min_prompt_tokens: int = 256  # auto: shorter prompts stay aggregated
    max_inflight_prefills: int = 8  # auto: at this many prefills in flight, the group is full
    auto: bool = True  # auto may disaggregate (False: only a forced route does)

    def __post_init__(self) -> None:
        if not (self.disaggregation or self.aggregation):
            raise ValueError("no serving path: configure a worker model or prefill and decode")


class Router:
    """Applies the policy and counts the prefills in flight (thread-safe)."""

    def __init__(self, policy: DisaggregationPolicy) -> None:
        self.policy = policy
        self._inflight = 0
        self._lock = threading.Lock()

    @property
    def inflight_prefills(self) -> int:
        return self._inflight

    def choose(self, requested: str, prompt_tokens: int) -> Route:
        """The route for a request (`requested`: the `route` parameter). A disaggregated choice
        counts as a prefill in flight until `prefill_done`."""
        p = self.policy
        with self._lock:
            if requested == "aggregated":
                if not p.aggregation:
                    raise InvalidRequest("route", "no worker model is configured")
                return Route.AGGREGATED
            if requested == "disaggregated":
                if not p.disaggregation:
                    raise InvalidRequest("route", "no prefill/decode models are configured")
            elif not p.aggregation:
                pass  # auto with only the disaggregated path
            elif (not p.disaggregation or not p.auto or prompt_tokens < p.min_prompt_tokens
                  or self._inflight >= p.max_inflight_prefills):
                return Route.AGGREGATED
            self._inflight += 1
            return Route.DISAGGREGATED

    def prefill_done(self) -> None:
        with self._lock:
            self._inflight -= 1
