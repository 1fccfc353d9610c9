"""Network helpers shared by the launcher, engine rank groups, tests and benchmarks."""

from __future__ import annotations

import socket

_given: set[int] = set()  # ports free_port returned in this process


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server or a rank group's rendezvous), and
    not one it returned before in this process: callers take several before any is bound, and
    the kernel may offer a port it just offered again (a server given the same port for HTTP
    and gRPC refuses to start)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _given:
            _given.add(port)
            return port
    raise OSError("no TCP port on 127.0.0.1 that this process was not given before")
