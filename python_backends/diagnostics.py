"""Thread stack dumps on demand, for a request that hangs.

Every stub and engine rank calls `enable_stack_dumps` when it starts; `kill -USR1 <pid>` then
makes that process write each thread's Python stack to its stderr, which is the server log (the
stubs inherit tritonserver's). It is Python's faulthandler: it needs no debugger, no ptrace
permission, and works while the GIL is held by a stuck thread. The end-to-end tests send it to
every stub when a test fails, so a hang in CI comes with its stacks.
"""

from __future__ import annotations

import faulthandler
import signal

STACK_DUMP_SIGNAL = signal.SIGUSR1


def enable_stack_dumps() -> None:
    """Make STACK_DUMP_SIGNAL dump every thread's stack to stderr (idempotent)."""
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
