"""Which server serves a request. A policy sees each server as a `ServerView` (its health and
the load its metrics showed, plus the gateway's own count of requests it sent there since) and
returns the servers to try, best first; the gateway tries the next one when a server fails a
request before its first token. Policies are pure, so tests drive them with recorded views."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# A KV cache this full makes a server a poor choice even with an empty queue: it is about to
# preempt. Load counts sequences; KV usage counts as this many sequences at 100%.
KV_USAGE_WEIGHT = 8.0


@dataclass(frozen=True)
class ServerView:
    name: str
    region: str
    weight: float
    healthy: bool
    waiting: float = 0.0  # sequences queued in its engines (llm_num_requests_waiting)
    running: float = 0.0  # sequences decoding (llm_num_requests_running)
    kv_usage: float = 0.0  # the fullest engine's KV-cache usage, 0..1
    in_flight: int = 0  # requests the gateway has open on it now

    @property
    def load(self) -> float:
        """Work per unit of weight: what least-loaded routing minimizes. The gateway's own
        count covers what the server's metrics have not shown yet (they are read once a
        second)."""
        queued = max(self.waiting + self.running, float(self.in_flight))
        return (queued + KV_USAGE_WEIGHT * self.kv_usage) / self.weight


class RoutingPolicy(Protocol):
    def rank(self, servers: list[ServerView]) -> list[ServerView]:
        """The healthy servers allowed to serve the request, best first."""
        ...


class LeastLoaded:
    """The healthy server with the least load per weight first; ties go to the name, so that
    equal servers are ranked the same way every time."""

    def rank(self, servers: list[ServerView]) -> list[ServerView]:
        return sorted((s for s in servers if s.healthy), key=lambda s: (s.load, s.name))
