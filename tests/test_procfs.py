"""The process table as /proc shows it: a child running, then a zombie, then gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from python_backends import procfs


def test_child_running_zombie_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "marker-7"])
    try:
        proc = procfs.process(child.pid)
        assert proc is not None and proc.running and proc.ppid == os.getpid()
        assert proc.pgrp == os.getpgrp()
        assert proc.cmdline() == [sys.executable, "-c", "import time; time.sleep(30)",
                                  "marker-7"]
        assert child.pid in {p.pid for p in procfs.running_children(os.getpid())}
        assert child.pid in {p.pid for p in procfs.processes()}
        os.kill(child.pid, 9)
        deadline = time.monotonic() + 5
        while (p := procfs.process(child.pid)) is not None and p.running:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert p is not None and p.state == "Z"  # exited, not reaped yet
        assert child.pid not in {p.pid for p in procfs.running_children(os.getpid())}
    finally:
        child.kill()
        child.wait()
    assert procfs.process(child.pid) is None
    assert procfs.process(2**22 + 1) is None  # above any pid_max
