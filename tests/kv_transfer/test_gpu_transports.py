"""KV handoff out of GPU memory between processes: CUDA IPC (device to device) and NIXL with
VRAM registered (to a GPU pool and to a host pool). Needs a GPU; skipped elsewhere by the `gpu`
marker."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from python_backends.flag_board import BoardCache, FlagBoard
from python_backends.kv_transfer import nixl
from python_backends.kv_transfer.base import KVHandle
from python_backends.kv_transfer.layout import KVLayout, allocate_pool
from tests.kv_transfer import test_transports

pytestmark = pytest.mark.gpu
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32",
                  num_blocks=24)


def _owner(conn: Any) -> None:
    from python_backends.kv_transfer.cuda_ipc import CudaIpcSource

    torch.manual_seed(0)
    pool = torch.randn(LAYOUT.shape, device="cuda")
    board = FlagBoard.create(size=4)
    ticket = board.acquire()
    source = CudaIpcSource(pool)
    handle = KVHandle("cuda_ipc", "owner", LAYOUT, (3, 4, 17), 10, time.time() + 30,
                      board.name, ticket, source.location())
    conn.send((handle.to_json(), pool.cpu()))
    deadline = time.time() + 30
    while not board.is_cancelled(ticket) and time.time() < deadline:
        time.sleep(0.001)
    conn.send(board.is_cancelled(ticket))
    conn.recv()
    board.close()


def test_pull_device_to_device_across_processes() -> None:
    from python_backends.kv_transfer.cuda_ipc import CudaIpcSink

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child,), daemon=True)
    proc.start()
    text, src = parent.recv()
    handle = KVHandle.from_json(text)
    dst_layout = KVLayout(**{**LAYOUT.to_dict(), "num_blocks": 8})
    dst = torch.zeros(dst_layout.shape, device="cuda")
    boards = BoardCache()
    sink = CudaIpcSink(dst_layout, dst, boards)
    dst_blocks = [7, 0, 1]
    assert sink.pull(handle, dst_blocks) == handle.nbytes
    bs = LAYOUT.block_size
    out = dst.cpu()
    for sb, db in zip(handle.block_ids, dst_blocks, strict=True):
        assert torch.equal(out[:, :, db * bs : (db + 1) * bs], src[:, :, sb * bs : (sb + 1) * bs])
    assert not out[:, :, 2 * bs : 7 * bs].any()
    assert parent.recv() is True  # released on the owner's board
    parent.send("bye")
    proc.join(10)
    boards.close()


@pytest.mark.parametrize("dst_device", ["cuda", "cpu"], ids=["vram-to-vram", "vram-to-dram"])
def test_nixl_pulls_from_gpu_memory_across_processes(dst_device: str) -> None:
    """The prefill side's pool is on the GPU (registered as VRAM); decode pulls it into a GPU
    pool, or into a host pool (a CPU decode instance beside a GPU prefill)."""
    if not nixl.available():
        pytest.skip("NIXL (nixl-cu12 or nixl-cu13) not installed")
    with test_transports.owner_process("nixl", device="cuda") as owned:
        assert owned[0].location["mem_type"] == "VRAM"
        layout = KVLayout(**{**test_transports.LAYOUT.to_dict(), "num_blocks": 16})
        dst = allocate_pool(layout, device=torch.device(dst_device))
        boards = BoardCache()
        sink = nixl.NixlSink(layout, dst, nixl.agent_name("test-puller"), boards)
        test_transports.pull_and_check(sink, owned, dst)
        sink.close()
        boards.close()
