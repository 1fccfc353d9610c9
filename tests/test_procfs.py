"""The process table as /proc shows it: a child running, then a zombie, then gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from python_backends import procfs


def test_child_running_zombie_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "marker-7"])
    try:
        proc = procfs.process(child.pid)
        assert proc is not None and proc.running and proc.ppid == os.getpid()
        assert procfs.running(child.pid)
        assert proc.pgrp == os.getpgrp()
        want = [sys.executable, "-c", "import time; time.sleep(30)", "marker-7"]
        deadline = time.monotonic() + 5  # on a busy machine the exec may still be under way
        while proc.cmdline() != want and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.cmdline() == want
        assert child.pid in {p.pid for p in procfs.running_children(os.getpid())}
        assert child.pid in {p.pid for p in procfs.processes()}
        assert not proc.catches(signal.SIGUSR1) and not proc.catches(signal.SIGTERM)
        os.kill(child.pid, 9)
        deadline = time.monotonic() + 5
        while (p := procfs.process(child.pid)) is not None and p.running:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert p is not None and p.state == "Z"  # exited, not reaped yet
        assert p.memory() is None and p.status()["State"].startswith("Z")
        assert not procfs.running(child.pid)
        assert child.pid not in {p.pid for p in procfs.running_children(os.getpid())}
    finally:
        child.kill()
        child.wait()
    assert procfs.process(child.pid) is None
    assert procfs.process(2**22 + 1) is None  # above any pid_max


def test_descendants_and_signal_handlers() -> None:
    """A grandchild is found through its parent; a registered handler shows in `catches`."""
    script = ("import signal, subprocess, sys, time; "
              "signal.signal(signal.SIGUSR2, lambda *_: None); "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
              "time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 10
        while len(found := procfs.running_descendants(child.pid)) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (grandchild,) = found
        assert grandchild.ppid == child.pid
        me = {p.pid: p for p in procfs.running_descendants(os.getpid())}
        assert child.pid in me and grandchild.pid in me
        while not me[child.pid].catches(signal.SIGUSR2):  # the handler is set at start-up
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not me[child.pid].catches(signal.SIGUSR1)
        assert not grandchild.catches(signal.SIGUSR2)
    finally:
        for p in procfs.running_descendants(child.pid):
            os.kill(p.pid, signal.SIGKILL)
        child.kill()
        child.wait()
    assert not procfs.Process(child.pid, "Z", 0, 0).catches(signal.SIGUSR2)


def test_resident_memory_of_this_process() -> None:
    me = procfs.process(os.getpid())
    memory = me.memory() if me is not None else None
    assert memory is not None and 10 << 20 < memory.rss < 64 << 30
    assert memory.anon > 0 and memory.file > 0
    gone = procfs.Process(2**22 + 7, "Z", 1, 1)
    assert gone.memory() is None and gone.threads() == 0 and gone.status() == {}


def test_shared_memory_a_process_touches_is_counted_apart() -> None:
    from multiprocessing import shared_memory

    me = procfs.process(os.getpid())
    assert me is not None
    before = me.memory()
    segment = shared_memory.SharedMemory(create=True, size=16 << 20)
    try:
        buf = segment.buf
        assert buf is not None
        chunk = b"x" * (1 << 20)
        for start in range(0, 16 << 20, 1 << 20):  # touch every page, 1 MiB of private at once
            buf[start:start + (1 << 20)] = chunk
        after = me.memory()
        assert before is not None and after is not None
        assert after.shmem - before.shmem >= 16 << 20
        assert after.anon - before.anon < 8 << 20
    finally:
        segment.close()
        segment.unlink()


def test_threads_and_resident_shared_memory_by_segment() -> None:
    import mmap
    import threading
    import uuid

    name = f"procfs_test_{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/{name}"
    with open(path, "w+b") as f:
        f.truncate(64 * 4096)
        region = mmap.mmap(f.fileno(), 64 * 4096)
    try:
        me = procfs.process(os.getpid())
        assert me is not None
        assert me.shm_resident()[name] == 0  # mapped, nothing touched yet
        region[:3 * 4096] = b"x" * (3 * 4096)
        assert me.shm_resident()[name] == 3 * 4096
        before = me.threads()
        stop = threading.Event()
        worker = threading.Thread(target=stop.wait)
        worker.start()
        assert me.threads() == before + 1
        stop.set()
        worker.join()
    finally:
        region.close()
        os.unlink(path)


def test_the_cpu_is_described_by_its_model_and_instruction_sets() -> None:
    described = procfs.cpu_description()
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    have = [f for f in procfs.ISA_FLAGS if f in flags]
    assert described.endswith(f"({', '.join(have)})" if have else ")")


def test_memory_available_is_what_meminfo_says() -> None:
    available = procfs.memory_available()
    assert available is not None and available > 0
    total = next(int(ln.split()[1]) for ln in
                 Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal:"))
    assert available <= total * 1024
