"""`cuda_ipc`: same node, GPU. The owner exports its pool's CUDA allocation once (an IPC handle,
through torch's CUDA IPC reductions); the puller maps it on first use and copies the blocks
device to device (one gather and one scatter over the blocks' slots), then raises the release
flag on the owner's board. Needs both pools on CUDA devices of one node.
"""

from __future__ import annotations

import base64
import pickle
import threading
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from python_backends.flag_board import BoardCache
from python_backends.kv_transfer.base import (
    Failure,
    KVHandle,
    KVSink,
    KVSource,
    TransferError,
    node_id,
)
from python_backends.kv_transfer.layout import KVLayout


def _slots(layout: KVLayout, blocks: list[int], device: torch.device) -> torch.Tensor:
    b = torch.tensor(blocks, dtype=torch.long, device=device)[:, None]
    return (b * layout.block_size + torch.arange(layout.block_size, device=device)).view(-1)


class CudaIpcSource(KVSource):
    kind = "cuda_ipc"

    def __init__(self, pool: torch.Tensor) -> None:
        if not pool.is_cuda:
            raise ValueError("cuda_ipc needs the KV pool on a CUDA device")
        self.pool = pool  # kept alive: pullers map its allocation
        _rebuild, args = reduce_tensor(pool)
        self._location = {"ipc": base64.b64encode(pickle.dumps(args)).decode(), "node": node_id()}

    def location(self) -> dict[str, Any]:
        return self._location


class CudaIpcSink(KVSink):
    kind = "cuda_ipc"
    same_node = True

    def __init__(self, layout: KVLayout, pool: torch.Tensor, boards: BoardCache) -> None:
        if not pool.is_cuda:
            raise ValueError("cuda_ipc needs the KV pool on a CUDA device")
        super().__init__(layout, boards)
        self.pool = pool
        self._owner_pools: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def _owner_pool(self, handle: KVHandle) -> torch.Tensor:
        key = handle.location["ipc"]
        with self._lock:
            src = self._owner_pools.get(key)
            if src is None:
                try:
                    src = rebuild_cuda_tensor(*pickle.loads(base64.b64decode(key)))
                except Exception as e:  # a dead owner, another node, no peer access (CUDA P2P)
                    raise TransferError(Failure.ERROR, f"cannot map the KV pool: {e}") from None
                if tuple(src.shape) != handle.layout.shape:
                    raise TransferError(Failure.LAYOUT, "mapped pool does not match its layout")
                self._owner_pools[key] = src
            return src

    def _copy(self, handle: KVHandle, dst_blocks: list[int]) -> None:
        src = self._owner_pool(handle)
        src_layout = handle.layout
        planes = src_layout.planes * src_layout.num_layers
        width = src_layout.num_kv_heads * src_layout.head_dim
        src_view = src.view(planes, -1, width)
        dst_view = self.pool.view(planes, -1, width)
        moved = src_view.index_select(1, _slots(src_layout, list(handle.block_ids), src.device))
        dst_view.index_copy_(1, _slots(self.layout, dst_blocks, self.pool.device),
                             moved.to(self.pool.device, non_blocking=True))
        torch.cuda.current_stream(self.pool.device).synchronize()  # done before the release
        self.release_on_board(handle)
