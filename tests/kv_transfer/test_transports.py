"""Both transports across real processes: the owner's pool lives in a child process."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from python_backends.flag_board import BoardCache, FlagBoard
from python_backends.kv_transfer import nixl
from python_backends.kv_transfer.base import Failure, KVHandle, KVSink, TransferError
from python_backends.kv_transfer.host_shm import HostShmSink, HostShmSource, SharedPool
from python_backends.kv_transfer.layout import KVLayout, allocate_pool
from python_backends.kv_transfer.leases import LeaseTable

LAYOUT = KVLayout(num_layers=4, num_kv_heads=3, head_dim=8, block_size=4, dtype="float32",
                  num_blocks=32)
BLOCKS = (5, 6, 7, 20)
OWNER_START_S = 60.0


def _owner(kind: str, conn: Any, device: str = "cpu") -> None:
    """Child: fill a pool (on `device`), lease BLOCKS, serve until the lease is released or
    expires. Sends the handle and a CPU copy of the pool, then the lease's end (expired?)."""
    torch.manual_seed(0)
    board = FlagBoard.create(size=4)
    if kind == "host_shm":
        shared = SharedPool.create(LAYOUT)
        pool = shared.tensor
        source: Any = HostShmSource(shared.name)
    else:
        pool = allocate_pool(LAYOUT, device=torch.device(device))
        source = nixl.NixlSource(pool, nixl.agent_name("test-owner"))
    pool.copy_(torch.randn(LAYOUT.shape))
    table = LeaseTable(board)
    lease = table.grant(BLOCKS, duration_s=20.0)
    handle = KVHandle(kind, "owner", LAYOUT, lease.blocks, 14, lease.deadline, board.name,
                      lease.ticket, source.location())
    conn.send((handle.to_json(), pool.cpu().clone()))
    reaped: list[Any] = []
    while not reaped:
        reaped = table.reap(source.released())
        time.sleep(0.001)
    conn.send(reaped[0].expired)
    conn.recv()  # keep the pool alive until the parent is done
    source.close()
    if kind == "host_shm":
        shared.close()
    board.close()


@pytest.fixture(params=["host_shm", "nixl"])
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "nixl" and not nixl.available():
        pytest.skip("NIXL (nixl-cu12 or nixl-cu13) not installed")
    return str(request.param)


@contextmanager
def owner_process(kind: str, device: str = "cpu") -> Iterator[tuple[KVHandle, torch.Tensor, Any]]:
    """An owner in a child process: yields its handle, a CPU copy of its pool and the pipe."""
    ctx = mp.get_context("spawn")  # not fork: the parent may hold NIXL/UCX threads
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(kind, child, device), daemon=True)
    proc.start()
    try:
        # Bounded: on the one GPU machine tried, an owner registering VRAM never answered.
        assert parent.poll(OWNER_START_S), f"the {kind} owner on {device} sent no handle " \
                                           f"within {OWNER_START_S:.0f} s"
        text, pool = parent.recv()
        yield KVHandle.from_json(text), pool, parent
        parent.send("bye")
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


@pytest.fixture
def owner(kind: str) -> Iterator[tuple[KVHandle, torch.Tensor, Any]]:
    with owner_process(kind) as owned:
        yield owned


def _sink(kind: str, pool: torch.Tensor, boards: BoardCache) -> KVSink:
    dst_layout = KVLayout(**{**LAYOUT.to_dict(), "num_blocks": 16})
    if kind == "host_shm":
        return HostShmSink(dst_layout, pool, boards)
    return nixl.NixlSink(dst_layout, pool, nixl.agent_name("test-puller"), boards)


def pull_and_check(sink: KVSink, owned: tuple[KVHandle, torch.Tensor, Any],
                   dst: torch.Tensor) -> None:
    """Pull the owner's blocks into `dst`: exactly their bytes land, nothing else is written,
    and the owner sees its lease released (not expired)."""
    handle, src, conn = owned
    dst_blocks = [9, 10, 0, 1]
    assert sink.pull(handle, dst_blocks) == handle.nbytes == LAYOUT.bytes_for(4)
    out, bs = dst.cpu(), LAYOUT.block_size
    for sb, db in zip(handle.block_ids, dst_blocks, strict=True):
        assert torch.equal(out[:, :, db * bs : (db + 1) * bs], src[:, :, sb * bs : (sb + 1) * bs])
    assert out[:, :, 2 * bs : 9 * bs].abs().sum() == 0  # nothing else was written
    sink.flush()
    assert conn.poll(10) and conn.recv() is False  # released, not expired


def test_pull_releases_the_lease_across_processes(kind: str, owner: Any) -> None:
    dst = allocate_pool(KVLayout(**{**LAYOUT.to_dict(), "num_blocks": 16}))
    boards = BoardCache()
    sink = _sink(kind, dst, boards)
    pull_and_check(sink, owner, dst)
    sink.close()
    boards.close()


def test_refusals_name_the_reason(kind: str, owner: Any) -> None:
    handle, _src, conn = owner
    dst = allocate_pool(KVLayout(**{**LAYOUT.to_dict(), "num_blocks": 16}))
    boards = BoardCache()
    sink = _sink(kind, dst, boards)
    cases = [
        (handle.__class__(**{**handle.__dict__, "deadline": time.time() - 1}), Failure.EXPIRED),
        (handle.__class__(**{**handle.__dict__, "fault": "transfer_error"}), Failure.ERROR),
        (handle.__class__(**{**handle.__dict__,
                             "layout": KVLayout(**{**LAYOUT.to_dict(), "head_dim": 4})}),
         Failure.LAYOUT),
    ]
    if kind == "host_shm":  # shared memory reaches this node only
        cases.append((handle.__class__(**{**handle.__dict__, "location": {
            **handle.location, "node": "elsewhere/0"}}), Failure.UNREACHABLE))
    for bad, failure in cases:
        with pytest.raises(TransferError) as info:
            sink.pull(bad, [0, 1, 2, 3])
        assert info.value.kind is failure
    assert not dst.any()
    sink.abandon(handle)
    assert conn.poll(10) and conn.recv() is False
    sink.close()
    boards.close()


class SlowAgent:
    """A real NIXL agent whose READs stay in progress ("PROC") for `seconds`: a peer that
    stopped answering, or answers late."""

    def __init__(self, agent: Any, seconds: float) -> None:
        self._agent = agent
        self.done_at = time.monotonic() + seconds
        self.released = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def transfer(self, xfer: Any) -> str:
        return "PROC"

    def check_xfer_state(self, xfer: Any) -> str:
        return "PROC" if time.monotonic() < self.done_at else "DONE"

    def release_xfer_handle(self, xfer: Any) -> None:
        self.released += 1
        self._agent.release_xfer_handle(xfer)


@pytest.mark.parametrize("kind", ["nixl"])
@pytest.mark.parametrize(("seconds", "failure"), [(1e9, Failure.IN_DOUBT),
                                                  (0.15, Failure.TIMEOUT)])
def test_a_timed_out_nixl_read_is_waited_for_before_its_blocks_are_given_up(
    owner: Any, kind: str, seconds: float, failure: Failure
) -> None:
    """Past its timeout a READ gets a grace period to end by itself. One that ends is a plain
    timeout (the blocks may be reused); one that still runs is cancelled and reported IN_DOUBT,
    so the engine never reuses its blocks (engine.kv_handoff.BlocksInDoubt)."""
    if not nixl.available():
        pytest.skip("NIXL (nixl-cu12 or nixl-cu13) not installed")
    handle, _src, conn = owner
    boards = BoardCache()
    layout = KVLayout(**{**LAYOUT.to_dict(), "num_blocks": 16})
    sink = nixl.NixlSink(layout, allocate_pool(layout), nixl.agent_name("test-puller"), boards,
                         timeout_s=0.05, cancel_grace_s=0.3)
    slow = SlowAgent(sink.agent.agent, seconds)
    sink.agent.agent = slow
    with pytest.raises(TransferError) as info:
        sink.pull(handle, [0, 1, 2, 3])
    assert info.value.kind is failure and slow.released == 1
    sink.abandon(handle)
    assert conn.poll(10) and conn.recv() is False  # the lease is given back at once
    sink.close()
    boards.close()
