"""`nixl`: any placement NIXL reaches (processes, nodes; DRAM here, VRAM on GPUs).

The owner registers its whole pool with its agent once at start-up and puts the agent's metadata
and the pool's base address in every handle; the puller, whose pool is registered with its own
agent, READs the blocks' byte ranges (pull) and then notifies the owner, which frees them.
Notifications are batched per owner and sent by `flush` (the decode engine calls it after a
step's pulls): a transfer posted right behind a notification to the same owner waits for it.

Agents run without NIXL's progress thread (on a small CPU it spins a core and collapsed
throughput; see docs/platform.md), so each side progresses its agent itself: the puller by polling
its transfer, the owner by polling notifications (`released`) while it holds leases. An agent is
not thread-safe: every call goes through the wrapper's lock.

NIXL ships one build per CUDA major version (PyPI `nixl-cu12`, `nixl-cu13`); the one matching
torch's CUDA is used. GPU memory is offered to NIXL only where that build matches (`vram_problem`):
with nixl-cu12 beside torch for CUDA 13, an owner registering its GPU pool hung on an H200
(docs/platform.md, "NIXL"). Creating an agent over GPU memory is bounded in time either way.
"""

from __future__ import annotations

import base64
import functools
import importlib
import threading
import time
import uuid
from types import ModuleType
from typing import Any

import numpy as np
import torch

from python_backends.flag_board import BoardCache
from python_backends.kv_transfer.base import Failure, KVHandle, KVSink, KVSource, TransferError
from python_backends.kv_transfer.layout import KVLayout, byte_ranges

RELEASE_PREFIX = b"release:"
BUILDS = {12: "nixl_cu12", 13: "nixl_cu13"}  # NIXL's Python package by CUDA major version
# How long creating an agent and registering a GPU pool may take (well under a second where
# it works) before the instance's load fails naming it, instead of hanging.
VRAM_AGENT_TIMEOUT_S = 60.0


def torch_cuda_major() -> int | None:
    """The CUDA major version torch was built for; None for a CPU-only torch."""
    return int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None


@functools.cache
def _api() -> ModuleType | None:
    """NIXL's API from the build for torch's CUDA, else any build installed (DRAM is the same
    to every build)."""
    want = BUILDS.get(torch_cuda_major() or 12, "")
    for name in sorted(BUILDS.values(), key=lambda n: n != want):
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    return None


def build() -> str | None:
    """The NIXL package in use (`nixl_cu12`, `nixl_cu13`), or None where none is installed."""
    api = _api()
    return api.__name__.split(".")[0] if api is not None else None


def available() -> bool:
    return _api() is not None


def vram_problem() -> str | None:
    """Why NIXL is not offered GPU memory here (`kv_transports: auto`), or None where it is."""
    name = build()
    if name is None:
        return "NIXL is not installed"
    major = torch_cuda_major()
    if major is None:
        return "torch has no CUDA"
    if name != BUILDS.get(major):
        wanted = BUILDS[major].replace("_", "-") if major in BUILDS else "a build for it"
        return (f"{name} is built for another CUDA than torch's ({torch.version.cuda}), and "
                f"registering GPU memory with such a build hung (install {wanted})")
    return None


class Agent:
    """A NIXL agent with its pool registered once, behind one lock."""

    def __init__(self, name: str, pool: torch.Tensor) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.pool = pool
        self.base = pool.data_ptr()
        self.mem_type = "VRAM" if pool.is_cuda else "DRAM"
        self.device = max(pool.get_device(), 0)
        if pool.is_cuda:
            self.agent, self._registration, self.metadata = _bounded(
                lambda: _register(name, pool), VRAM_AGENT_TIMEOUT_S,
                f"NIXL agent {name} over GPU memory ({build()})")
        else:
            self.agent, self._registration, self.metadata = _register(name, pool)

    def close(self) -> None:
        with self.lock:
            self.agent.deregister_memory(self._registration)


def _register(name: str, pool: torch.Tensor) -> tuple[Any, Any, bytes]:
    """A new agent, `pool` registered with it, and its metadata (taken after registering:
    it carries the registrations)."""
    api = _api()
    if api is None:
        raise TransferError(Failure.ERROR, "NIXL is not installed")
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False))
    registration = agent.register_memory(pool)
    return agent, registration, agent.get_agent_metadata()


def _bounded(make: Any, seconds: float, what: str) -> Any:
    """make() on a thread of its own, waited for at most `seconds`: a TransferError after that
    (the thread is left behind, blocked where NIXL blocked it)."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(make())
        except BaseException as e:  # handed to the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name=f"nixl-register-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if errors:
        raise errors[0]
    if not result:
        raise TransferError(Failure.TIMEOUT, f"{what}: not created within {seconds:.0f} s "
                                             "(docs/platform.md, \"NIXL\")")
    return result[0]


def agent_name(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:12]}"


class NixlSource(KVSource):
    kind = "nixl"

    def __init__(self, pool: torch.Tensor, name: str) -> None:
        self.agent = Agent(name, pool)
        self._location = {
            "agent": name,
            "metadata": base64.b64encode(self.agent.metadata).decode(),
            "base": self.agent.base,
            "mem_type": self.agent.mem_type,
            "device": self.agent.device,
        }

    def location(self) -> dict[str, Any]:
        return self._location

    def released(self) -> list[int]:
        with self.agent.lock:
            notifs = self.agent.agent.get_new_notifs()  # also progresses the agent
        return [
            int(ticket)
            for msgs in notifs.values() for msg in msgs if msg.startswith(RELEASE_PREFIX)
            for ticket in msg[len(RELEASE_PREFIX) :].split(b",")
        ]

    def close(self) -> None:
        self.agent.close()


class NixlSink(KVSink):
    kind = "nixl"

    def __init__(
        self, layout: KVLayout, pool: torch.Tensor, name: str, boards: BoardCache,
        timeout_s: float = 5.0, cancel_grace_s: float = 10.0,
    ) -> None:
        super().__init__(layout, boards)
        self.agent = Agent(name, pool)
        self.timeout_s = timeout_s
        self.cancel_grace_s = cancel_grace_s
        self._owners: set[str] = set()
        self._releases: dict[str, list[int]] = {}  # owner -> tickets pulled, not yet released

    def _owner(self, handle: KVHandle) -> str:
        name = str(handle.location["agent"])
        if name not in self._owners:
            metadata = base64.b64decode(handle.location["metadata"])
            with self.agent.lock:
                self.agent.agent.add_remote_agent(metadata)
            self._owners.add(name)
        return name

    def _copy(self, handle: KVHandle, dst_blocks: list[int]) -> None:
        owner = self._owner(handle)
        loc = handle.location
        ranges = byte_ranges(handle.layout, self.layout, list(handle.block_ids), dst_blocks)
        remote = np.stack([ranges[:, 0] + int(loc["base"]), ranges[:, 2],
                           np.full(len(ranges), int(loc["device"]))], axis=1).astype(np.uint64)
        local = np.stack([ranges[:, 1] + self.agent.base, ranges[:, 2],
                          np.full(len(ranges), self.agent.device)], axis=1).astype(np.uint64)
        a = self.agent.agent
        with self.agent.lock:
            xfer = a.initialize_xfer(
                "READ", a.get_xfer_descs(local, self.agent.mem_type),
                a.get_xfer_descs(remote, str(loc["mem_type"])), owner,
            )
            try:
                state = self._wait(a, xfer, a.transfer(xfer), self.timeout_s)
                if state == "PROC":
                    # Too slow. Cancelling (releasing the handle) does not stop bytes already
                    # on their way into our blocks, so first wait for the READ to end by itself.
                    state = self._wait(a, xfer, state, self.cancel_grace_s)
                    if state == "PROC":
                        raise TransferError(Failure.IN_DOUBT, (
                            f"NIXL READ from {owner} still running {self.timeout_s} + "
                            f"{self.cancel_grace_s} s after it started; cancelled, its blocks "
                            "are never reused"))
                    raise TransferError(Failure.TIMEOUT,
                                        f"NIXL READ from {owner} took over {self.timeout_s} s")
                if state != "DONE":
                    raise TransferError(Failure.ERROR, f"NIXL READ from {owner} failed: {state}")
            finally:
                a.release_xfer_handle(xfer)  # cancels the READ if it still runs
        self._releases.setdefault(owner, []).append(handle.release_ticket)

    @staticmethod
    def _wait(agent: Any, xfer: Any, state: str, seconds: float) -> str:
        """Poll a transfer while it is in progress ("PROC"), for at most `seconds`."""
        deadline = time.monotonic() + seconds
        spins = 0
        while state == "PROC" and time.monotonic() <= deadline:
            spins += 1
            if spins > 200:
                time.sleep(0.0001)
            state = agent.check_xfer_state(xfer)
        return str(state)

    def flush(self) -> None:
        if not self._releases:
            return
        with self.agent.lock:
            for owner, tickets in self._releases.items():
                msg = RELEASE_PREFIX + ",".join(map(str, tickets)).encode()
                self.agent.agent.send_notif(owner, msg)
            self._releases.clear()
            self.agent.agent.get_new_notifs()  # progresses the agent: the messages go out now

    def close(self) -> None:
        self.agent.close()
