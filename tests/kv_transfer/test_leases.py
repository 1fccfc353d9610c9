from collections.abc import Iterator

import pytest

from python_backends.flag_board import FlagBoard
from python_backends.kv_transfer.leases import LeaseTable


@pytest.fixture
def board() -> Iterator[FlagBoard]:
    b = FlagBoard.create(size=8)
    yield b
    b.close()


def test_release_by_flag_by_transport_and_by_expiry(board: FlagBoard) -> None:
    now = [100.0]
    table = LeaseTable(board, clock=lambda: now[0])
    a = table.grant([1, 2], 10.0)
    b = table.grant([3], 10.0)
    c = table.grant([4, 5, 6], 5.0)
    assert len(table) == 3 and table.num_blocks == 6
    assert table.reap() == []
    board.cancel(a.ticket)  # a puller on this node, or the front on a cancel
    reaped = table.reap(released=[b.ticket])  # a NIXL notification
    assert {(r.lease.ticket, r.expired) for r in reaped} == {(a.ticket, False), (b.ticket, False)}
    now[0] = 105.0
    [r] = table.reap()
    assert r.lease == c and r.expired
    assert len(table) == 0 and table.reap(released=[a.ticket]) == []


def test_a_stale_release_cannot_free_a_newer_lease(board: FlagBoard) -> None:
    table = LeaseTable(board)
    old = table.grant([1], 10.0)
    board.cancel(old.ticket)
    assert len(table.reap()) == 1
    new = table.grant([2], 10.0)  # may reuse the slot, with another tag
    board.cancel(old.ticket)
    assert table.reap(released=[old.ticket]) == [] and len(table) == 1
    board.cancel(new.ticket)
    assert len(table.reap()) == 1
