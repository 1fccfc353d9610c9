"""Stack dumps on demand: a process that enabled them writes its threads' stacks when asked,
and one that did not is left alone. The processes asked are a given server's descendants only
(here a stand-in parent's two children: this test's own process may have a real server under
it, the e2e session's)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from python_backends.diagnostics import request_stack_dumps

CHILD = """
import sys, time
from python_backends.diagnostics import enable_stack_dumps
if sys.argv[1] == "on":
    enable_stack_dumps()
print("ready", flush=True)
def waiting_here():
    time.sleep(30)
waiting_here()
"""

PARENT = """
import subprocess, sys, time
children = [subprocess.Popen([sys.executable, "-c", sys.argv[1], mode], stdout=subprocess.PIPE,
                             stderr=open(f"{sys.argv[2]}/{mode}.err", "w"), text=True)
            for mode in ("on", "off")]
for child in children:
    child.stdout.readline()
print("ready", flush=True)
time.sleep(30)
"""


def test_every_process_that_catches_the_signal_dumps_its_stacks_and_keeps_running(
    tmp_path: Path,
) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "ready\n"
        assert request_stack_dumps(parent.pid, pause_s=0.1) == 1  # of its two children
        time.sleep(0.5)
        alive = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True,
                               text=True).stdout.split()
        assert len(alive) == 2  # both children still run
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(parent.pid)], check=False)
        parent.wait(timeout=10)
    assert "waiting_here" in (tmp_path / "on.err").read_text()  # the thread's stack
    assert (tmp_path / "off.err").read_text() == ""
