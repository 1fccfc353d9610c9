"""Thread stack dumps on demand, for a request that hangs.

Every stub and engine rank calls `enable_stack_dumps` when it starts; `kill -USR1 <pid>` then
makes that process write each thread's Python stack to its stderr, which is the server log (the
stubs inherit tritonserver's). It is Python's faulthandler: it needs no debugger, no ptrace
permission, and works while the GIL is held by a stuck thread. The end-to-end tests and the soak
send it to every stub (`request_stack_dumps`) when a test fails or a request hangs, so a hang
comes with its stacks.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time

from python_backends import procfs

STACK_DUMP_SIGNAL = signal.SIGUSR1


def enable_stack_dumps() -> None:
    """Make STACK_DUMP_SIGNAL dump every thread's stack to stderr (idempotent)."""
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)


def request_stack_dumps(server_pid: int, pause_s: float = 0.3) -> int:
    """Ask every process under tritonserver `server_pid` that catches STACK_DUMP_SIGNAL for its
    stacks, one at a time (they share the server log, so each writes its dump whole before the
    next starts); returns how many were asked."""
    asked = 0
    for proc in procfs.running_descendants(server_pid):
        if proc.catches(STACK_DUMP_SIGNAL):
            try:
                os.kill(proc.pid, STACK_DUMP_SIGNAL)
            except ProcessLookupError:
                continue  # exited meanwhile
            asked += 1
            time.sleep(pause_s)
    return asked
