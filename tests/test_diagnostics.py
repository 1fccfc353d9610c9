"""Stack dumps on demand: a process that enabled them writes its threads' stacks when asked,
and one that did not is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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


def _child(mode: str) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child


def test_every_process_that_catches_the_signal_dumps_its_stacks_and_keeps_running() -> None:
    dumping, plain = _child("on"), _child("off")
    try:
        assert request_stack_dumps(os.getpid(), pause_s=0.1) == 1  # this test's children
        time.sleep(0.5)
        assert dumping.poll() is None and plain.poll() is None  # both still run
    finally:
        for child in (dumping, plain):
            child.kill()
    _, err = dumping.communicate(timeout=10)
    assert "waiting_here" in err  # the stack of the thread, with its function
    assert plain.communicate(timeout=10)[1] == ""
