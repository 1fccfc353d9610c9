import pytest

from python_backends.cancel_board import BoardCache, BoardFull, CancelBoard


def test_flags_cross_mappings_and_slots_recycle() -> None:
    owner = CancelBoard.create(size=4)
    cache = BoardCache()
    try:
        reader = cache.get(owner.name)
        assert cache.get(owner.name) is reader
        tickets = [owner.acquire() for _ in range(4)]
        with pytest.raises(BoardFull):
            owner.acquire()
        reader.cancel(tickets[1])
        assert owner.is_cancelled(tickets[1]) and not owner.is_cancelled(tickets[0])
        owner.release(tickets[1])
        again = owner.acquire()
        assert again // 256 == tickets[1] // 256 and not reader.is_cancelled(again)
        reader.cancel(tickets[1])  # a late cancellation of the finished request ...
        assert not owner.is_cancelled(again)  # ... does not touch the slot's new owner
    finally:
        cache.close()
        owner.close()
    assert not owner.path.exists()
