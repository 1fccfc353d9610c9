"""Which server serves a request. A policy sees each server as a `ServerView` (its health and
the load its metrics showed, plus the gateway's own count of requests it sent there since) and
the request as a `RouteRequest`, and returns the servers to try, best first; the gateway tries
the next one when a server fails a request before its first token. Policies are small objects
that wrap one another (residency, then canary, then latency, then an order: least-loaded or
prefix-aware), pure but for the prefix index, so tests drive them with recorded views.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from python_backends.front.tenancy import CacheSharing
from python_backends.prefix_hash import BlockHash, prefix_hashes

# A KV cache this full makes a server a poor choice even with an empty queue: it is about to
# preempt. Load counts sequences; KV usage counts as this many sequences at 100%.
KV_USAGE_WEIGHT = 8.0
# prefix_aware: a prompt block a server would have to compute weighs as this many KV blocks its
# engines hold. At 1 (Dynamo's default) a conversation's next turn follows the load, not its
# cached history; 4 keeps it with its history and still spreads requests evenly
# (scripts/bench_routing.py, docs/benchmarks.md "Routing across servers").
DEFAULT_OVERLAP_WEIGHT = 4.0


@dataclass(frozen=True)
class ServerView:
    name: str
    region: str
    weight: float
    healthy: bool
    waiting: float = 0.0  # sequences queued in its engines (llm_num_requests_waiting)
    running: float = 0.0  # sequences decoding (llm_num_requests_running)
    kv_usage: float = 0.0  # the fullest engine's KV-cache usage, 0..1
    kv_blocks_used: float = 0.0  # KV blocks its engines hold (llm_kv_cache_blocks_used)
    ttft_p95_s: float | None = None  # over the last minute; None: no request finished
    canary: bool = False
    in_flight: int = 0  # requests the gateway has open on it now
    # How its engines key cached KV (prefix_hash): tokens per block (llm_kv_block_size_tokens;
    # 0 when it publishes none) and its front's prefix_cache_shared_tenants.
    block_size: int = 0
    cache_sharing: CacheSharing = field(default_factory=CacheSharing)

    @property
    def load(self) -> float:
        """Work per unit of weight: what least-loaded routing minimizes. The gateway's own
        count covers what the server's metrics have not shown yet (they are read once a
        second)."""
        queued = max(self.waiting + self.running, float(self.in_flight))
        return (queued + KV_USAGE_WEIGHT * self.kv_usage) / self.weight


@dataclass(frozen=True)
class RouteRequest:
    tenant: str
    user: str = ""  # canary stickiness (the tenant when empty)
    region: str = ""  # the client's region (header x-region); "" unknown
    token_ids: tuple[int, ...] = ()  # the prompt's, when a policy reads them
    cache_salt: str = ""  # the request's own cache_salt, if it sent one
    _prefixes: dict[tuple[int, str], tuple[BlockHash, ...]] = field(
        default_factory=dict, compare=False, repr=False)

    def prefix(self, block_size: int, sharing: CacheSharing) -> tuple[BlockHash, ...]:
        """The prompt's block hashes as engines with this block size behind a front with this
        cache sharing key them (computed once per kind of server)."""
        salt = sharing.salt(self.tenant, self.cache_salt)
        key = (block_size, salt)
        if key not in self._prefixes:
            self._prefixes[key] = prefix_hashes(self.token_ids, block_size, salt)
        return self._prefixes[key]


class RoutingPolicy(Protocol):
    def rank(self, servers: Sequence[ServerView], req: RouteRequest) -> list[ServerView]:
        """The healthy servers allowed to serve the request, best first."""
        ...

    def record(self, server: str, req: RouteRequest) -> None:
        """`server` took the request (the prefix index learns from it)."""
        ...


class LeastLoaded:
    """The healthy server with the least load per weight first; ties go to the name, so that
    equal servers are ranked the same way every time."""

    def rank(self, servers: Sequence[ServerView], req: RouteRequest) -> list[ServerView]:
        return sorted((s for s in servers if s.healthy), key=lambda s: (s.load, s.name))

    def record(self, server: str, req: RouteRequest) -> None:
        pass


class PrefixAware:
    """Dynamo's trade-off: a server's cost is `overlap_weight` x the prompt blocks it would
    have to compute (those past the longest prefix it was recently sent) plus the KV blocks
    its engines hold now (its decode load), per unit of weight. Prompts are hashed as each
    server's engines hash them (prefix_hash, with the server's block size and salt rules), so a
    prefix counts only where an engine could find it. The index is approximate: the prefixes
    the gateway sent each server, the newest `max_blocks` per server.
    `default_block_size`: for a server that publishes no block size (a front-only server)."""

    def __init__(self, overlap_weight: float = DEFAULT_OVERLAP_WEIGHT,
                 max_blocks: int = 100_000, default_block_size: int = 16) -> None:
        self.overlap_weight = overlap_weight
        self.max_blocks = max_blocks
        self.default_block_size = default_block_size
        self._index: dict[str, OrderedDict[int, None]] = {}
        self._keys: dict[str, tuple[int, CacheSharing]] = {}  # each server's, as last seen

    def prefix(self, s: ServerView, req: RouteRequest) -> tuple[BlockHash, ...]:
        key = self._keys[s.name] = (s.block_size or self.default_block_size, s.cache_sharing)
        return req.prefix(*key)

    def overlap(self, server: str, prefix: tuple[int, ...]) -> int:
        seen = self._index.get(server, OrderedDict())
        n = 0
        for h in prefix:
            if h not in seen:
                break
            n += 1
        return n

    def cost(self, s: ServerView, req: RouteRequest) -> float:
        prefix = self.prefix(s, req)
        to_compute = len(prefix) - self.overlap(s.name, prefix)
        return (self.overlap_weight * to_compute + s.kv_blocks_used) / s.weight

    def rank(self, servers: Sequence[ServerView], req: RouteRequest) -> list[ServerView]:
        return sorted((s for s in servers if s.healthy),
                      key=lambda s: (self.cost(s, req), s.load, s.name))

    def record(self, server: str, req: RouteRequest) -> None:
        key = self._keys.get(server, (self.default_block_size, CacheSharing()))
        seen = self._index.setdefault(server, OrderedDict())
        for h in req.prefix(*key):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)


@dataclass
class LatencyAware:
    """Servers in the client's region first while their TTFT p95 is within `bound_s`; the
    others (another region, or over the bound: spill-over) after them, each part in the inner
    policy's order."""

    inner: RoutingPolicy
    bound_s: float

    def rank(self, servers: Sequence[ServerView], req: RouteRequest) -> list[ServerView]:
        ranked = self.inner.rank(servers, req)
        near = [s for s in ranked if req.region and s.region == req.region
                and (s.ttft_p95_s is None or s.ttft_p95_s <= self.bound_s)]
        return near + [s for s in ranked if s not in near]

    def record(self, server: str, req: RouteRequest) -> None:
        self.inner.record(server, req)


@dataclass
class Canary:
    """A `fraction` of users (sticky: by a hash of the user, else the tenant) go to the canary
    servers first; everyone else is served by the others only, unless none of them is left."""

    inner: RoutingPolicy
    fraction: float

    def in_canary(self, req: RouteRequest) -> bool:
        key = (req.user or req.tenant).encode()
        bucket = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64
        return bucket < self.fraction

    def rank(self, servers: Sequence[ServerView], req: RouteRequest) -> list[ServerView]:
        ranked = self.inner.rank(servers, req)
        canary = [s for s in ranked if s.canary]
        stable = [s for s in ranked if not s.canary]
        if self.in_canary(req):
            return canary + stable
        return stable or canary

    def record(self, server: str, req: RouteRequest) -> None:
        self.inner.record(server, req)


@dataclass
class Residency:
    """A tenant with allowed regions is served only by servers in them (none healthy there:
    nothing, and the gateway answers 503); other tenants anywhere."""

    inner: RoutingPolicy
    allowed: dict[str, frozenset[str]] = field(default_factory=dict)

    def rank(self, servers: Sequence[ServerView], req: RouteRequest) -> list[ServerView]:
        regions = self.allowed.get(req.tenant)
        if regions is not None:
            servers = [s for s in servers if s.region in regions]
        return self.inner.rank(servers, req)

    def record(self, server: str, req: RouteRequest) -> None:
        self.inner.record(server, req)
