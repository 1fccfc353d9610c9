"""Network helpers shared by the launcher, engine rank groups, tests and benchmarks."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_given: set[int] = set()  # ports free_port returned in this process
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: ports that well-known services are configured on


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (a bind to port 0, a connection's local
    end)."""
    try:
        low, _high = (int(v) for v in EPHEMERAL_RANGE.read_text().split())
        return low
    except (OSError, ValueError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server or a rank group's rendezvous),
    outside the kernel's ephemeral range, and not one it returned before in this process.

    Outside the range: a server told its ports binds them only after its models load, and a
    loading model's sockets (a listener on port 0, an outgoing connection) take ephemeral ports,
    so a port the kernel offered once could be its own again by then (tritonserver then fails
    with "Address already in use"). Not returned before: callers take several before any is
    bound (a server given the same port for HTTP and gRPC refuses to start)."""
    high = _ephemeral_low() - 1
    if high - LOWEST >= 1000:
        for _ in range(1000):
            port = random.randint(LOWEST, high)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    for _ in range(1000):  # a machine whose ephemeral range leaves nothing below it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _given:
            _given.add(port)
            return port
    raise OSError("no TCP port on 127.0.0.1 that this process was not given before")
