"""The handoff interface: a KV handle, the owner's side (`KVSource`) and the puller's (`KVSink`).

Protocol, whatever the transport:
1. The owner (a prefill instance) computes a prompt and keeps its blocks under a lease: a release
   ticket on the owner's release board (python_backends.flag_board) and a deadline.
2. The handle (JSON, a few hundred bytes plus the transport's location) travels with the request.
3. The puller (a decode instance) allocates blocks and `pull`s the owner's blocks into them,
   then releases the lease (NIXL: a notification, batched until `flush`; same node: the flag
   on the owner's release board). A pull that fails, times out or finds the lease
   expired raises `TransferError`; the puller then `abandon`s the lease (its flag, where the
   board is on this node) and recomputes the prompt itself.
4. The owner frees leased blocks on release, or when the deadline passes (the puller never came,
   or came too late: it checks the deadline after copying and discards a late copy).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from python_backends.flag_board import BoardCache
from python_backends.kv_transfer.layout import KVLayout


class Failure(enum.Enum):
    ERROR = "error"  # the transport failed
    TIMEOUT = "timeout"
    EXPIRED = "expired"  # the lease ran out before the copy completed
    LAYOUT = "layout"  # the blocks' layout does not fit the receiver
    # A copy that neither finished nor stopped when cancelled: it may still write into the
    # destination blocks, which must never be used again (see engine.kv_handoff).
    IN_DOUBT = "in_doubt"
    UNREACHABLE = "unreachable"  # a same-node transport's handle from another node


@functools.cache
def node_id() -> str:
    """This machine: its host name and boot id (two containers of one pod share the host
    name but, in different pods, not the memory a same-node transport needs)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


class TransferError(RuntimeError):
    def __init__(self, kind: Failure, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class KVHandle:
    """Names leased KV blocks: whose, which, their layout and until when."""

    transport: str
    owner: str  # the owning instance, for logs
    layout: KVLayout
    block_ids: tuple[int, ...]
    num_tokens: int  # tokens whose K/V the blocks hold
    deadline: float  # time.time() after which the owner may reuse the blocks
    release_board: str  # the owner's release board and this lease's ticket on it
    release_ticket: int
    location: dict[str, Any] = field(default_factory=dict)  # transport-specific address
    fault: str = ""  # fault injection for tests and drills: "" or "transfer_error"

    @property
    def nbytes(self) -> int:
        return self.layout.bytes_for(len(self.block_ids))

    def remaining(self) -> float:
        return self.deadline - time.time()

    def to_json(self) -> str:
        d = {**self.__dict__, "layout": self.layout.to_dict(), "block_ids": list(self.block_ids)}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> KVHandle:
        d = json.loads(text)
        d["layout"] = KVLayout.from_dict(d["layout"])
        d["block_ids"] = tuple(d["block_ids"])
        return cls(**d)


class KVSource(ABC):
    """The owner's side of one transport, over the owner's whole pool. A transport that
    reaches one node only (shared memory, CUDA IPC) puts `node_id()` in its locations."""

    kind: str

    @abstractmethod
    def location(self) -> dict[str, Any]:
        """What a puller needs to reach the pool; copied into every handle."""

    def released(self) -> list[int]:
        """Release tickets that arrived over the transport itself since the last call."""
        return []

    def close(self) -> None:
        return None


class KVSink(ABC):
    """The puller's side of one transport, into the puller's whole pool."""

    kind: str
    same_node = False  # refuses handles whose location names another node

    def __init__(self, layout: KVLayout, boards: BoardCache) -> None:
        self.layout = layout
        self._boards = boards

    def pull(self, handle: KVHandle, dst_blocks: list[int]) -> int:
        """Copy the handle's blocks into `dst_blocks` of the local pool and release the lease
        (some transports only at the next `flush`); returns bytes moved."""
        problem = self.layout.incompatibility(handle.layout)
        if problem is not None:
            raise TransferError(Failure.LAYOUT, f"KV layout mismatch: {problem}")
        if len(dst_blocks) != len(handle.block_ids):
            raise ValueError(f"{len(dst_blocks)} blocks for {len(handle.block_ids)}")
        if any(not 0 <= b < self.layout.num_blocks for b in dst_blocks):
            raise ValueError(f"destination blocks outside the pool: {dst_blocks}")
        if any(not 0 <= b < handle.layout.num_blocks for b in handle.block_ids):
            raise TransferError(Failure.LAYOUT, "handle names blocks outside its pool")
        if handle.remaining() <= 0:
            raise TransferError(Failure.EXPIRED, f"lease expired {-handle.remaining():.3f} s ago")
        if handle.fault == "transfer_error":
            raise TransferError(Failure.ERROR, "injected transfer failure")
        node = handle.location.get("node")
        if self.same_node and node != node_id():
            raise TransferError(Failure.UNREACHABLE, (
                f"{self.kind} reaches the KV of this node only: the handle comes from node "
                f"{node}, this is {node_id()} (use nixl between nodes)"))
        self._copy(handle, dst_blocks)
        if handle.remaining() <= 0:  # the owner may have reused the blocks while we copied
            raise TransferError(Failure.EXPIRED, "lease expired during the copy")
        return handle.nbytes

    @abstractmethod
    def _copy(self, handle: KVHandle, dst_blocks: list[int]) -> None:
        """Copy the blocks, then release the lease or queue its release for `flush`."""

    def flush(self) -> None:
        """Send queued releases."""
        return None

    def abandon(self, handle: KVHandle) -> None:
        abandon(handle, self._boards)

    def release_on_board(self, handle: KVHandle) -> None:
        self._boards.get(handle.release_board).cancel(handle.release_ticket)

    def close(self) -> None:
        return None


def abandon(handle: KVHandle, boards: BoardCache) -> None:
    """Give up a lease without pulling: raise its flag if the owner's board is on this node;
    otherwise, or once the deadline has passed, the owner reaps it as expired."""
    if handle.remaining() <= 0:
        return
    with contextlib.suppress(OSError, ValueError):
        boards.get(handle.release_board).cancel(handle.release_ticket)
