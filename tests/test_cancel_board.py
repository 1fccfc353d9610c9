from python_backends.cancel_board import CancelBoard


def test_flags_cross_mappings_and_slots_recycle() -> None:
    owner = CancelBoard.create(size=4)
    try:
        reader = CancelBoard.attach(owner.name)
        slots = [owner.acquire() for _ in range(4)]
        assert None not in slots and owner.acquire() is None
        owner.cancel(slots[1])  # type: ignore[arg-type]
        assert reader.is_cancelled(slots[1]) and not reader.is_cancelled(slots[0])  # type: ignore[arg-type]
        owner.release(slots[1])  # type: ignore[arg-type]
        again = owner.acquire()
        assert again == slots[1] and not reader.is_cancelled(again)  # type: ignore[arg-type]
        reader.close()
    finally:
        owner.close()
    assert not owner.path.exists()
