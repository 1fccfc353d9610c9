"""Admission policies on a simulated clock."""

import pytest

from python_backends.front.admission import (
    AdmissionControl,
    AdmissionLimits,
    RateLimit,
    RateLimiter,
    Rejected,
    RejectReason,
    TokenBucket,
    parse_rate_limits,
)
from tests.conftest import Clock


def test_token_bucket_refills_at_its_rate_up_to_capacity() -> None:
    clock = Clock()
    b = TokenBucket(rate=2.0, capacity=4.0, clock=clock)
    assert all(b.try_take(1) for _ in range(4)) and not b.try_take(1)
    clock.t = 0.5
    assert b.try_take(1) and not b.try_take(1)
    clock.t = 100.0
    assert b.try_take(4) and not b.try_take(0.5)


def test_rate_limiter_per_tenant_requests_and_tokens() -> None:
    clock = Clock()
    limits = parse_rate_limits(
        '{"default": {"requests_per_s": 2}, "big": {"tokens_per_s": 100, "burst_tokens": 150}}'
    )
    rl = RateLimiter(limits, clock)
    rl.check("a", 10)
    rl.check("a", 10)
    with pytest.raises(Rejected) as e:
        rl.check("a", 10)
    assert e.value.reason is RejectReason.RATE_LIMITED and "'a'" in str(e.value)
    rl.check("b", 10)  # its own buckets under the default limits
    rl.check("big", 150)
    with pytest.raises(Rejected, match="tokens/s"):
        rl.check("big", 1)
    clock.t = 1.0
    rl.check("a", 10)
    rl.check("big", 100)
    RateLimiter({}, clock).check("anyone", 10**9)  # no limits configured


def test_rate_limit_validation() -> None:
    with pytest.raises(ValueError):
        RateLimit(requests_per_s=-1)
    with pytest.raises(ValueError):
        parse_rate_limits("[1, 2]")


def test_admission_bounds_waiting_requests_and_tokens() -> None:
    ac = AdmissionControl(AdmissionLimits(max_waiting_requests=2, max_waiting_tokens=100))
    ac.enter(40)
    with pytest.raises(Rejected, match="prompt tokens waiting") as e:
        ac.enter(61)
    assert e.value.reason is RejectReason.OVERLOADED
    ac.enter(60)
    with pytest.raises(Rejected, match="requests waiting"):
        ac.enter(1)
    ac.leave(40)
    ac.enter(1)
    assert (ac.waiting_requests, ac.waiting_tokens) == (2, 61)
