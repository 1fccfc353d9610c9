"""Cross-process flags: one byte per ticket in a shared-memory file, raised by one process and
read by others for free. Two boards use it: the front's cancel board (postprocessing raises a
request's flag when its client goes away; the front and the engine holding the sequence drop
it) and a prefill instance's lease board (a decode instance raises a lease's flag to release its
KV blocks). Why cancellation needs it: Triton 2.51 never tells the decoupled front step of an
ensemble, nor a BLS callee, that a client cancelled (docs/platform.md).

A flag is addressed by a ticket (slot and a per-slot generation tag), so a late flag for a
finished request can never hit the next request that reuses its slot.

Each slot also records which engine process holds the request now (`hold`, `holder`): an
engine writes its pid when a request reaches it, and the front, waiting on an engine that went
quiet, tells from the pid whether that engine is still alive (see front.migration).

A board's name carries its owner's pid, so a reader also tells that the owner is gone
(`owner_alive`): its stub died, nothing it asked for is wanted, and every ticket on its board
reads as raised."""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
import uuid
from pathlib import Path

from python_backends import procfs

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "triton_llm_cancel_"
_TAGS = 255  # tags 1..255; byte 0 means "not cancelled"
OWNER_CHECK_S = 1.0  # how stale `owner_alive` may be
# After the flag bytes, one record per slot: the holder's ticket and pid (0: none yet).
_HOLDER = struct.Struct("<II")
_SLOT_BYTES = 1 + _HOLDER.size


class BoardFull(RuntimeError):
    pass


def _pid_in(name: str) -> str:
    """The owner's pid as the board's name spells it (`<prefix><pid>_<tag>`)."""
    return name[len(NAME_PREFIX):].split("_")[0]


def map_shared(path: Path, size: int, owner: bool) -> mmap.mmap:
    """Map a shared-memory file of `size` bytes: the owner creates it (zeroed), others open it."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if owner else 0), 0o600)
    try:
        if owner:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class FlagBoard:
    def __init__(self, path: Path, size: int, owner: bool) -> None:
        self.path = path
        self.size = size  # slots
        self._owner = owner
        self._map = map_shared(path, size * _SLOT_BYTES, owner)
        self._free = list(range(size - 1, -1, -1)) if owner else []
        self._tags = [0] * size if owner else []
        self._lock = threading.Lock()
        self._owner_alive = True
        self._owner_checked = time.monotonic()

    @classmethod
    def create(cls, size: int = 1 << 16) -> FlagBoard:
        return cls(SHM_DIR / f"{NAME_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}", size, True)

    @classmethod
    def attach(cls, name: str) -> FlagBoard:
        path = SHM_DIR / name
        if (not name.startswith(NAME_PREFIX) or path.parent != SHM_DIR
                or not _pid_in(name).isdigit()):
            raise ValueError(f"not a cancel board: {name!r}")
        return cls(path, path.stat().st_size // _SLOT_BYTES, False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def owner_pid(self) -> int:
        """The pid of the process that created the board (from its name)."""
        return int(_pid_in(self.name))

    def owner_alive(self) -> bool:
        """Whether the creator is still running (not exited, not a zombie). Read from /proc at
        most every OWNER_CHECK_S; once gone, gone for good."""
        if self._owner or not self._owner_alive:
            return self._owner_alive
        now = time.monotonic()
        if now - self._owner_checked >= OWNER_CHECK_S:
            self._owner_checked = now
            self._owner_alive = procfs.running(self.owner_pid)
        return self._owner_alive

    def acquire(self) -> int:
        """A ticket for a new request (owner only). Raises BoardFull when every slot is taken."""
        with self._lock:
            if not self._free:
                raise BoardFull(f"more than {self.size} requests in flight")
            slot = self._free.pop()
            self._tags[slot] = self._tags[slot] % _TAGS + 1
            tag = self._tags[slot]
        ticket = slot * 256 + tag
        self._map[slot] = 0
        self.hold(ticket, 0)
        return ticket

    def release(self, ticket: int) -> None:
        with self._lock:
            self._free.append(ticket // 256)

    def cancel(self, ticket: int) -> None:
        self._map[ticket // 256] = ticket % 256

    def is_cancelled(self, ticket: int) -> bool:
        """The ticket's flag is raised, or the board's owner is gone."""
        return self._map[ticket // 256] == ticket % 256 or not self.owner_alive()

    def hold(self, ticket: int, pid: int) -> None:
        """Record that process `pid` holds the ticket's request now (an engine, on arrival)."""
        _HOLDER.pack_into(self._map, self.size + ticket // 256 * _HOLDER.size, ticket, pid)

    def holder(self, ticket: int) -> int:
        """The pid of the process holding the ticket's request; 0 while none has said so."""
        held, pid = _HOLDER.unpack_from(self._map, self.size + ticket // 256 * _HOLDER.size)
        return int(pid) if held == ticket else 0

    def close(self) -> None:
        self._map.close()
        if self._owner:
            self.path.unlink(missing_ok=True)


class BoardCache:
    """Boards attached by name, once per process (engine and postprocessing stubs)."""

    def __init__(self) -> None:
        self._boards: dict[str, FlagBoard] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> FlagBoard:
        with self._lock:
            board = self._boards.get(name)
            if board is None:
                board = self._boards[name] = FlagBoard.attach(name)
            return board

    def close(self) -> None:
        with self._lock:
            for board in self._boards.values():
                board.close()
            self._boards.clear()
