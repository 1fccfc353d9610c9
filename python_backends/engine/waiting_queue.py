"""The order in which an engine starts its waiting sequences.

Two policies behind one small interface: `FcfsQueue` (arrival order) and `PriorityFairQueue`
(strict priority classes; within a class, deficit round robin over tenants, charged in tokens, so
a tenant sending ten times more requests does not get ten times the service).

Preempted sequences return to the front of their queue: they started before and keep
their place.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Iterator

from python_backends.engine.sequence import Sequence


def cost(seq: Sequence) -> int:
    """Tokens a sequence asks for: its prompt and its output budget."""
    return seq.num_prompt_tokens + seq.params.max_tokens


class WaitingQueue(abc.ABC):
    @abc.abstractmethod
    def push(self, seq: Sequence) -> None: ...

    @abc.abstractmethod
    def push_front(self, seq: Sequence) -> None: ...

    @abc.abstractmethod
    def peek(self) -> Sequence | None:
        """The sequence to start next; repeated calls return it until `pop` takes it."""

    @abc.abstractmethod
    def pop(self) -> Sequence: ...

    @abc.abstractmethod
    def remove(self, seq: Sequence) -> None: ...

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Sequence]: ...

    @abc.abstractmethod
    def __bool__(self) -> bool: ...

    def __len__(self) -> int:
        return sum(1 for _ in self)


class FcfsQueue(WaitingQueue):
    def __init__(self) -> None:
        self._q: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        self._q.append(seq)

    def push_front(self, seq: Sequence) -> None:
        self._q.appendleft(seq)

    def peek(self) -> Sequence | None:
        return self._q[0] if self._q else None

    def pop(self) -> Sequence:
        return self._q.popleft()

    def remove(self, seq: Sequence) -> None:
        self._q.remove(seq)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._q)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)


class _DeficitRoundRobin:
    """One priority class: a queue per tenant, served in turn; each visit adds
    `quantum * weight` tokens of credit and a tenant's head runs once its credit covers it."""

    def __init__(self, weights: dict[str, float], quantum: int) -> None:
        self._weights = weights
        self._quantum = quantum
        self._queues: dict[str, deque[Sequence]] = {}
        self._deficit: dict[str, float] = {}
        self._order: deque[str] = deque()  # tenants with waiting sequences, in service order

    def _weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self._weights.get("default", 1.0))

    def push(self, seq: Sequence, front: bool = False) -> None:
        q = self._queues.setdefault(seq.tenant, deque())
        if not q:
            self._order.append(seq.tenant)
            self._deficit.setdefault(seq.tenant, 0.0)
        if front:
            q.appendleft(seq)
        else:
            q.append(seq)

    def peek(self) -> Sequence | None:
        while self._order:
            tenant = self._order[0]
            head = self._queues[tenant][0]
            if self._deficit[tenant] >= cost(head):
                return head
            self._deficit[tenant] += self._quantum * self._weight(tenant)
            self._order.rotate(-1)
        return None

    def pop(self) -> Sequence:
        head = self.peek()
        assert head is not None, "pop from an empty queue"
        tenant = head.tenant
        self._queues[tenant].popleft()
        self._deficit[tenant] -= cost(head)
        if not self._queues[tenant]:
            self._order.popleft()
            self._deficit[tenant] = 0.0  # an idle tenant does not bank credit
        return head

    def remove(self, seq: Sequence) -> None:
        q = self._queues[seq.tenant]
        q.remove(seq)
        if not q:
            self._order.remove(seq.tenant)
            self._deficit[seq.tenant] = 0.0

    def __iter__(self) -> Iterator[Sequence]:
        for tenant in self._order:
            yield from self._queues[tenant]

    def __bool__(self) -> bool:
        return bool(self._order)


class PriorityFairQueue(WaitingQueue):
    """Higher `priority` first; fair across tenants (by `weights`) within a priority."""

    def __init__(self, weights: dict[str, float] | None = None, quantum: int = 64) -> None:
        self._weights = dict(weights or {})
        self._quantum = quantum
        self._classes: dict[int, _DeficitRoundRobin] = {}

    def _cls(self, priority: int) -> _DeficitRoundRobin:
        c = self._classes.get(priority)
        if c is None:
            c = self._classes[priority] = _DeficitRoundRobin(self._weights, self._quantum)
        return c

    def push(self, seq: Sequence) -> None:
        self._cls(seq.priority).push(seq)

    def push_front(self, seq: Sequence) -> None:
        self._cls(seq.priority).push(seq, front=True)

    def _top(self) -> _DeficitRoundRobin | None:
        for priority in sorted(self._classes, reverse=True):
            if self._classes[priority]:
                return self._classes[priority]
        return None

    def peek(self) -> Sequence | None:
        top = self._top()
        return None if top is None else top.peek()

    def pop(self) -> Sequence:
        top = self._top()
        assert top is not None, "pop from an empty queue"
        return top.pop()

    def remove(self, seq: Sequence) -> None:
        self._classes[seq.priority].remove(seq)

    def __iter__(self) -> Iterator[Sequence]:
        for priority in sorted(self._classes, reverse=True):
            yield from self._classes[priority]

    def __bool__(self) -> bool:
        return any(self._classes.values())
