"""Front-door admission: per-tenant rate limits and bounds on work waiting for an engine.

Policies are small objects with an injectable clock so they are tested on simulated time; the
front model consults them before a request reaches an engine, and a refused request never
holds a KV block.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from python_backends.wire import DEFAULT_TENANT

Clock = Callable[[], float]


class RejectReason(enum.Enum):
    OVERLOADED = "overloaded"
    RATE_LIMITED = "rate_limited"


# How a refusal's message begins: clients that only see the message (a gRPC stream through the
# 2.51 ensemble carries no status) tell "slow down" from "retry elsewhere" by it (the gateway).
RATE_LIMITED_PREFIX = "rate limited:"
OVERLOADED_PREFIX = "server overloaded:"


class Rejected(Exception):
    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TokenBucket:
    """`rate` units per second, bursts up to `capacity`. Not thread-safe on its own."""

    def __init__(self, rate: float, capacity: float, clock: Clock = time.monotonic) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be positive")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._level = capacity
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._last) * self.rate)
        self._last = now

    def try_take(self, amount: float) -> bool:
        self._refill()
        if amount > self._level:
            return False
        self._level -= amount
        return True


@dataclass(frozen=True)
class RateLimit:
    """Per-tenant limits; 0 means unlimited. Bursts default to one second's worth."""

    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0  # prompt tokens plus max_tokens, charged at admission
    burst_requests: float = 0.0
    burst_tokens: float = 0.0

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "tokens_per_s", "burst_requests", "burst_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"rate limit {name} must be >= 0")


def parse_rate_limits(text: str) -> dict[str, RateLimit]:
    """JSON `{"tenant": {"requests_per_s": .., "tokens_per_s": ..}, "default": {..}}`."""
    if not text.strip():
        return {}
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("rate_limits must be a JSON object of tenant -> limits")
    return {str(tenant): RateLimit(**limits) for tenant, limits in raw.items()}


class RateLimiter:
    """Token buckets per tenant, on requests/s and on tokens/s. Tenants without their own
    entry share the limits of "default" (each tenant its own buckets)."""

    def __init__(self, limits: dict[str, RateLimit], clock: Clock = time.monotonic) -> None:
        self._limits = limits
        self._clock = clock
        self._buckets: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}
        self._lock = threading.Lock()

    def limit(self, tenant: str) -> RateLimit:
        return self._limits.get(tenant, self._limits.get(DEFAULT_TENANT, RateLimit()))

    def _buckets_for(self, tenant: str) -> tuple[TokenBucket | None, TokenBucket | None]:
        buckets = self._buckets.get(tenant)
        if buckets is None:
            lim = self.limit(tenant)
            req = TokenBucket(lim.requests_per_s, lim.burst_requests or lim.requests_per_s,
                              self._clock) if lim.requests_per_s else None
            tok = TokenBucket(lim.tokens_per_s, lim.burst_tokens or lim.tokens_per_s,
                              self._clock) if lim.tokens_per_s else None
            buckets = self._buckets[tenant] = (req, tok)
        return buckets

    def check(self, tenant: str, tokens: int) -> None:
        """Charge one request of `tokens` tokens to the tenant, or raise Rejected."""
        with self._lock:
            req, tok = self._buckets_for(tenant)
            if req is not None and not req.try_take(1):
                raise Rejected(RejectReason.RATE_LIMITED,
                               f"{RATE_LIMITED_PREFIX} tenant '{tenant}' is over "
                               f"{req.rate:g} requests/s")
            if tok is not None and not tok.try_take(min(tokens, tok.capacity)):
                raise Rejected(RejectReason.RATE_LIMITED,
                               f"{RATE_LIMITED_PREFIX} tenant '{tenant}' is over "
                               f"{tok.rate:g} tokens/s")


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int = 256  # admitted, no first token yet
    max_waiting_tokens: int = 65536  # their prompt tokens

    def __post_init__(self) -> None:
        if self.max_waiting_requests <= 0 or self.max_waiting_tokens <= 0:
            raise ValueError("admission limits must be positive")


class AdmissionControl:
    """Backpressure: bounds the requests (and their prompt tokens) that wait for their first
    token. Past a bound, new requests are refused at once rather than queued without limit."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.waiting_requests = 0
        self.waiting_tokens = 0
        self._lock = threading.Lock()

    def enter(self, prompt_tokens: int) -> None:
        with self._lock:
            if self.waiting_requests + 1 > self.limits.max_waiting_requests:
                raise Rejected(RejectReason.OVERLOADED,
                               f"{OVERLOADED_PREFIX} {self.waiting_requests} requests waiting "
                               f"(limit {self.limits.max_waiting_requests}); retry later")
            if self.waiting_tokens + prompt_tokens > self.limits.max_waiting_tokens:
                raise Rejected(RejectReason.OVERLOADED,
                               f"{OVERLOADED_PREFIX} {self.waiting_tokens} prompt tokens waiting "
                               f"(limit {self.limits.max_waiting_tokens}); retry later")
            self.waiting_requests += 1
            self.waiting_tokens += prompt_tokens

    def leave(self, prompt_tokens: int) -> None:
        """The request got its first token, finished or failed: it no longer waits."""
        with self._lock:
            self.waiting_requests -= 1
            self.waiting_tokens -= prompt_tokens
