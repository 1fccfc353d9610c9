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


LOGGING_CHILD = """
import logging
from python_backends.diagnostics import log_to_stderr, set_up_process
set_up_process("worker_0_1")
log_to_stderr("another name")  # a second call changes nothing
logging.getLogger("python_backends.engine.example").info("kept %d", 1)
logging.getLogger("python_backends.engine.example").debug("below INFO")
logging.getLogger("some_library").info("not ours")
logging.getLogger("some_library").warning("a library warning")
"""


def test_a_process_logs_the_projects_info_records_to_stderr_once_tagged() -> None:
    """A stub's project log lines reach the server log (stderr) at INFO, tagged with its
    instance, each once; other libraries keep Python's default (warnings only)."""
    done = subprocess.run([sys.executable, "-c", LOGGING_CHILD], capture_output=True, text=True,
                          timeout=60, check=True)
    lines = done.stderr.splitlines()
    ours = [line for line in lines if "python_backends.engine.example" in line]
    assert len(ours) == 1
    assert ours[0].endswith("INFO [worker_0_1] python_backends.engine.example: kept 1")
    assert "below INFO" not in done.stderr and "not ours" not in done.stderr
    assert "a library warning" in done.stderr
