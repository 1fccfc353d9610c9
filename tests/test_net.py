"""free_port never hands out the same port twice in a process."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from python_backends import net


class FakeSocket:
    """A socket whose kernel offers the ports of `offers` in turn."""

    offers: Iterator[int] = iter(())

    def __enter__(self) -> FakeSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: Any) -> None:
        self.port = next(FakeSocket.offers)

    def getsockname(self) -> tuple[str, int]:
        return "127.0.0.1", self.port


def test_a_port_offered_again_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(net.socket, "socket", FakeSocket)
    monkeypatch.setattr(net, "_given", set())
    FakeSocket.offers = iter([5000, 5000, 5000, 5001])
    assert [net.free_port(), net.free_port()] == [5000, 5001]


def test_the_ports_are_free_and_distinct() -> None:
    ports = [net.free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nobody holds it
