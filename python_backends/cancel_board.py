"""Cross-process cancellation flags: one byte per in-flight request in a shared-memory file.

Triton 2.51's Python backend cannot cancel a BLS request, so when a client goes away the
scheduler (which sees the cancellation) raises the request's flag here and the engine instance
holding the sequence (whichever stub Triton routed it to) sees it at its next step and frees the
sequence's KV blocks. Reading a byte from a mapped page costs nothing per step.
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
from pathlib import Path

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "triton_llm_cancel_"


class CancelBoard:
    def __init__(self, path: Path, size: int, owner: bool) -> None:
        self.path = path
        self.size = size
        self._owner = owner
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if owner else 0), 0o600)
        try:
            if owner:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._free = list(range(size - 1, -1, -1)) if owner else []
        self._lock = threading.Lock()

    @classmethod
    def create(cls, size: int = 1 << 16) -> CancelBoard:
        return cls(SHM_DIR / f"{NAME_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}", size, True)

    @classmethod
    def attach(cls, name: str) -> CancelBoard:
        path = SHM_DIR / name
        if not name.startswith(NAME_PREFIX) or path.parent != SHM_DIR:
            raise ValueError(f"not a cancel board: {name!r}")
        return cls(path, path.stat().st_size, False)

    @property
    def name(self) -> str:
        return self.path.name

    def acquire(self) -> int | None:
        """A cleared slot for a new request, or None when all are in use (the request then
        simply cannot be cancelled early)."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        self._map[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def cancel(self, slot: int) -> None:
        self._map[slot] = 1

    def is_cancelled(self, slot: int) -> bool:
        return self._map[slot] == 1

    def close(self) -> None:
        self._map.close()
        if self._owner:
            self.path.unlink(missing_ok=True)
