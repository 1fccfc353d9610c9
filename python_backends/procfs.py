"""The process table, read from /proc (Linux): what the launcher, the stub watchdog and the
tests need to know about processes they did not start themselves or cannot wait for."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
SHM_PREFIX = "/dev/shm/"


@dataclass(frozen=True)
class Memory:
    """A process's resident memory in bytes: private (heap, stacks), file-backed (code,
    mapped files), and shared memory (/dev/shm segments it has touched)."""

    anon: int
    file: int
    shmem: int

    @property
    def rss(self) -> int:
        return self.anon + self.file + self.shmem


@dataclass(frozen=True)
class Process:
    pid: int
    state: str  # R, S, D, Z (zombie: exited, not yet reaped), ...
    ppid: int
    pgrp: int
    start_ticks: int = 0  # when it started, in clock ticks since boot

    @property
    def running(self) -> bool:
        """Alive: not a zombie waiting to be reaped."""
        return self.state != "Z"

    def cmdline(self) -> list[str] | None:
        """argv, None if the process is gone."""
        try:
            raw = (PROC / str(self.pid) / "cmdline").read_bytes()
        except OSError:
            return None
        return raw.decode(errors="replace").split("\0")[:-1]

    def status(self) -> dict[str, str]:
        """/proc/PID/status as fields by name, their values stripped (empty if it is gone)."""
        try:
            text = (PROC / str(self.pid) / "status").read_text()
        except OSError:
            return {}
        fields = (line.partition(":") for line in text.splitlines())
        return {key: value.strip() for key, _, value in fields}

    def memory(self) -> Memory | None:
        """Resident memory by kind, None if the process is gone."""
        status = self.status()
        try:
            anon, file, shmem = (int(status[k].split()[0]) * 1024
                                 for k in ("RssAnon", "RssFile", "RssShmem"))
        except KeyError:
            return None  # gone, or a zombie, which has no memory lines
        return Memory(anon=anon, file=file, shmem=shmem)

    def threads(self) -> int:
        """Its thread count (0 if it is gone)."""
        return int(self.status().get("Threads", 0))

    def shm_resident(self) -> dict[str, int]:
        """Resident bytes of each /dev/shm segment it maps, by segment name (empty if it is
        gone). Reads its whole smaps: costly for a process with thousands of mappings."""
        resident: dict[str, int] = {}
        segment = None
        try:
            with open(PROC / str(self.pid) / "smaps") as smaps:
                for line in smaps:
                    if line[0] in "0123456789abcdef":  # a mapping's header (fields are Names:)
                        parts = line.split()
                        path = parts[5] if len(parts) > 5 else ""
                        segment = path[len(SHM_PREFIX):] if path.startswith(SHM_PREFIX) else None
                    elif segment is not None and line.startswith("Rss:"):
                        resident[segment] = resident.get(segment, 0) + int(line.split()[1]) * 1024
        except OSError:
            return {}
        return resident

    def catches(self, signum: int) -> bool:
        """Whether the process has a handler for `signum` (False if it is gone): sending it a
        signal it does not catch may kill it."""
        caught = int(self.status().get("SigCgt", "0"), 16)
        return bool(caught >> (signum - 1) & 1)


# Instruction sets the engine's CPU paths depend on, as /proc/cpuinfo names them.
ISA_FLAGS = ("amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo; None where it cannot be read."""
    try:
        lines = (PROC / "cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(field)), "")


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags as /proc/cpuinfo names them (none if unreadable)."""
    return frozenset((_cpuinfo("flags") or "").split())


def memory_available() -> int | None:
    """Bytes the kernel reckons can be allocated without swapping (MemAvailable); None where
    /proc/meminfo cannot be read."""
    try:
        lines = (PROC / "meminfo").read_text().splitlines()
    except OSError:
        return None
    kib = next((ln.split()[1] for ln in lines if ln.startswith("MemAvailable:")), None)
    return int(kib) * 1024 if kib is not None and kib.isdigit() else None


def cpu_description() -> str:
    """The CPU's model name and which of ISA_FLAGS it has, for benchmark records."""
    model = _cpuinfo("model name")
    if model is None:
        return "unknown CPU"
    flags = cpu_flags()
    have = ", ".join(f for f in ISA_FLAGS if f in flags) or "none of " + "/".join(ISA_FLAGS)
    return f"{model or 'unknown CPU'} ({have})"


def process(pid: int | str) -> Process | None:
    """The process `pid`, None if it is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
    return Process(int(pid), fields[0], int(fields[1]), int(fields[2]), int(fields[19]))


def cpu_seconds(pid: int | str) -> float:
    """CPU time `pid` used so far, user and system, all its threads (0 if it is gone); `pid` may
    be "PID/task/TID" for one thread."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    proc = process(pid)
    return proc is not None and proc.running


def processes() -> Iterator[Process]:
    """Every process visible now (ones that exit while this runs are left out)."""
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (p := process(entry.name)) is not None:
            yield p


def running_children(ppid: int) -> list[Process]:
    return [p for p in processes() if p.ppid == ppid and p.running]


def running_descendants(pid: int) -> list[Process]:
    """Children, their children and so on, that are running."""
    table = [p for p in processes() if p.running]
    found: list[Process] = []
    parents = {pid}
    while parents:
        level = [p for p in table if p.ppid in parents]
        found += level
        parents = {p.pid for p in level}
    return found


STUB_BINARY = "triton_python_backend_stub"
STUB_SEGMENT_PREFIX = "triton_python_backend_shm_region_"  # a stub's segment in /dev/shm


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str
    instance: str
    started: int = 0  # start time (clock ticks since boot): the newest stub of an instance wins
    region: str = ""  # its shared-memory segment in /dev/shm, which tritonserver maps too


def stub_of(proc: Process) -> Stub | None:
    """The Python-backend stub `proc` is, None if it is another process (or gone)."""
    argv = proc.cmdline()
    if argv is None or len(argv) < 9 or not argv[0].endswith(STUB_BINARY):
        return None
    model_file = Path(argv[1])  # <repository>/<model>/<version>/model.py
    return Stub(proc.pid, model_file.parent.parent.name, argv[8], proc.start_ticks,
                argv[2].lstrip("/"))


def live_stubs(server_pid: int) -> list[Stub]:
    """The Python-backend stubs of a tritonserver process that are running (not zombies)."""
    return [s for proc in running_children(server_pid) if (s := stub_of(proc))]
