"""The owner's leases: blocks kept for a puller until it releases them or the deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from python_backends.flag_board import FlagBoard


@dataclass(frozen=True)
class Lease:
    ticket: int
    blocks: tuple[int, ...]
    deadline: float


@dataclass(frozen=True)
class Reaped:
    lease: Lease
    expired: bool  # the deadline passed without a release


class LeaseTable:
    """Leases by ticket. Releases arrive as raised flags on `board` (pullers on this node, and
    the front when a client cancels between prefill and decode) or as tickets a transport
    delivered (`reap(released=...)`)."""

    def __init__(self, board: FlagBoard, clock: Callable[[], float] = time.time) -> None:
        self.board = board
        self._clock = clock
        self._leases: dict[int, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def num_blocks(self) -> int:
        return sum(len(lease.blocks) for lease in self._leases.values())

    def grant(self, blocks: Iterable[int], duration_s: float) -> Lease:
        lease = Lease(self.board.acquire(), tuple(blocks), self._clock() + duration_s)
        self._leases[lease.ticket] = lease
        return lease

    def reap(self, released: Iterable[int] = ()) -> list[Reaped]:
        """Remove and return the leases that were released or have expired."""
        now = self._clock()
        out: list[Reaped] = []
        released = set(released)
        for ticket, lease in list(self._leases.items()):
            if ticket in released or self.board.is_cancelled(ticket):
                out.append(Reaped(lease, expired=False))
            elif now >= lease.deadline:
                out.append(Reaped(lease, expired=True))
            else:
                continue
            del self._leases[ticket]
            self.board.release(ticket)
        return out
