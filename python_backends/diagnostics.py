"""What every stub and engine rank sets up first (`set_up_process`): its log, and thread stack
dumps on demand, for a request that hangs.

Log records of the project's modules (`python_backends.*`) at INFO and above go to stderr, which
is the server log, tagged with the process's instance name: Python leaves logging unconfigured in
a stub, where only warnings would show (through logging's last-resort handler).

`kill -USR1 <pid>` then
makes that process write each thread's Python stack to its stderr, which is the server log (the
stubs inherit tritonserver's). It is Python's faulthandler: it needs no debugger, no ptrace
permission, and works while the GIL is held by a stuck thread. The end-to-end tests and the soak
send it to every stub (`request_stack_dumps`) when a test fails or a request hangs, so a hang
comes with its stacks.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time

from python_backends import procfs

STACK_DUMP_SIGNAL = signal.SIGUSR1


LOG_FORMAT = "%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s"


def set_up_process(name: str) -> None:
    """Stack dumps on demand and the project's log to stderr, tagged `name` (idempotent)."""
    enable_stack_dumps()
    log_to_stderr(name)


def log_to_stderr(name: str, level: int = logging.INFO) -> None:
    """The project's log records at `level` and above to stderr, each tagged `name`; once per
    process (a second call changes nothing)."""
    logger = logging.getLogger("python_backends")
    if any(getattr(h, "llm_process_log", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.llm_process_log = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(LOG_FORMAT.replace("{name}", name)))
    logger.addHandler(handler)
    logger.setLevel(level)


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
