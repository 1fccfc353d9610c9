"""Admission order: priority classes, and deficit round robin across tenants within one."""

from __future__ import annotations

from collections import Counter

from python_backends.engine.sequence import Sequence
from python_backends.engine.waiting_queue import FcfsQueue, PriorityFairQueue
from python_backends.params import SamplingParams


def seq(i: int, tenant: str = "default", priority: int = 0, tokens: int = 16) -> Sequence:
    return Sequence(str(i), [1] * (tokens // 2), SamplingParams(max_tokens=tokens - tokens // 2),
                    priority=priority, tenant=tenant)


def drain(q: PriorityFairQueue | FcfsQueue) -> list[Sequence]:
    out = []
    while q.peek() is not None:
        head = q.peek()
        assert q.peek() is head  # stable until popped
        out.append(q.pop())
    return out


def test_fcfs_and_front_insertion() -> None:
    q = FcfsQueue()
    a, b, c = seq(0), seq(1), seq(2)
    q.push(a)
    q.push(b)
    q.push_front(c)
    assert [s.seq_id for s in drain(q)] == ["2", "0", "1"] and not q


def test_priority_classes_first_then_arrival_within_a_tenant() -> None:
    q = PriorityFairQueue()
    for i, p in enumerate([0, 5, 0, 9, 5]):
        q.push(seq(i, priority=p))
    assert [s.seq_id for s in drain(q)] == ["3", "1", "4", "0", "2"]


def shares(weights: dict[str, float], counts: dict[str, int], served: int) -> Counter[str]:
    q = PriorityFairQueue(weights, quantum=16)
    n = 0
    for tenant, count in counts.items():
        for _ in range(count):
            q.push(seq(n, tenant))
            n += 1
    return Counter(s.tenant for s in drain(q)[:served])


def test_equal_weights_share_equally_despite_10x_more_requests() -> None:
    got = shares({}, {"a": 200, "b": 20}, served=40)  # both backlogged throughout
    assert abs(got["a"] - got["b"]) <= 0.15 * 20


def test_weights_3_to_1() -> None:
    got = shares({"a": 3.0, "b": 1.0}, {"a": 100, "b": 100}, served=80)
    assert abs(got["a"] / got["b"] - 3.0) <= 0.15 * 3.0


def test_remove_and_front_insertion_keep_order() -> None:
    q = PriorityFairQueue()
    s0, s1, s2 = seq(0, "a"), seq(1, "a"), seq(2, "b")
    for s in (s0, s1, s2):
        q.push(s)
    q.remove(s1)
    q.push_front(s1)
    # a's credit (one quantum of 256 tokens) covers both of its requests before b's turn
    assert len(q) == 3 and [s.seq_id for s in drain(q)] == ["1", "0", "2"]
