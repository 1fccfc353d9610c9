import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from python_backends import flag_board, procfs
from python_backends.flag_board import BoardCache, BoardFull, FlagBoard


def test_flags_cross_mappings_and_slots_recycle() -> None:
    owner = FlagBoard.create(size=4)
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


def test_owner_liveness_follows_the_creating_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine attached to a front's board learns when that front's process is gone
    (exited, or a zombie its parent has not reaped), so it can drop the front's requests."""
    monkeypatch.setattr(flag_board, "OWNER_CHECK_S", 0.0)
    script = ("import sys, time; from python_backends.flag_board import FlagBoard; "
              "b = FlagBoard.create(size=4); print(b.name, flush=True); "
              "sys.stdin.readline()")  # exits without closing: a stub that died
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    assert child.stdout is not None and child.stdin is not None
    name = child.stdout.readline().strip()
    board = FlagBoard.attach(name)
    try:
        assert board.owner_pid == child.pid and board.owner_alive()
        assert not board.is_cancelled(1 * 256 + 1)
        child.stdin.write("\n")
        child.stdin.flush()
        deadline = time.monotonic() + 10
        while board.owner_alive():  # a zombie until reaped below: already not alive
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert procfs.process(child.pid) is not None  # not reaped yet
        child.wait()
        assert not board.owner_alive()
        assert board.is_cancelled(1 * 256 + 1)  # every ticket of a dead owner
    finally:
        board.close()
        board.path.unlink(missing_ok=True)
    me = FlagBoard.create(size=4)
    try:
        assert me.owner_pid == os.getpid() and me.owner_alive()
    finally:
        me.close()


def test_attach_refuses_names_that_are_not_boards() -> None:
    for name in ("x", "triton_llm_cancel_abc_1234", "../triton_llm_cancel_1_2"):
        with pytest.raises(ValueError, match="not a cancel board"):
            FlagBoard.attach(name)


def test_holders_are_per_ticket_and_reset_for_the_next_request() -> None:
    owner = FlagBoard.create(size=2)
    engine = FlagBoard.attach(owner.name)
    try:
        ticket = owner.acquire()
        assert owner.holder(ticket) == 0
        engine.hold(ticket, 4242)  # an engine records itself when the request reaches it
        assert owner.holder(ticket) == 4242
        owner.release(ticket)
        again = owner.acquire()
        assert again // 256 == ticket // 256 and owner.holder(again) == 0
        engine.hold(ticket, 4343)  # a late record for the finished request is ignored
        assert owner.holder(again) == 0
    finally:
        engine.close()
        owner.close()
