"""free_port: free ports outside the kernel's ephemeral range, never the same twice a process."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from python_backends import net


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(net, "_given", set())


def offer(monkeypatch: pytest.MonkeyPatch, ports: list[int]) -> None:
    """The random choices free_port makes, in turn."""
    it = iter(ports)
    monkeypatch.setattr(net.random, "randint", lambda low, high: next(it))


def ephemeral(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> None:
    f = tmp_path / "ip_local_port_range"
    f.write_text(text)
    monkeypatch.setattr(net, "EPHEMERAL_RANGE", f)


@pytest.mark.usefixtures("fresh")
def test_a_port_given_before_or_held_is_skipped(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    ephemeral(monkeypatch, tmp_path, "32768 60999")
    held = {20002}
    monkeypatch.setattr(net, "_bindable", lambda port: port not in held)
    offer(monkeypatch, [20000, 20000, 20002, 20000, 20001])
    assert [net.free_port(), net.free_port()] == [20000, 20001]


@pytest.mark.usefixtures("fresh")
def test_the_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    ports = [net.free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    low = net._ephemeral_low()
    for port in ports:
        assert net.LOWEST <= port < low or low - net.LOWEST < 1000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nobody holds it


class FakeSocket:
    """A socket whose kernel offers the ports of `offers` in turn for port 0."""

    offers: Iterator[int] = iter(())

    def __enter__(self) -> FakeSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: Any) -> None:
        self.port = next(FakeSocket.offers) if address[1] == 0 else address[1]

    def getsockname(self) -> tuple[str, int]:
        return "127.0.0.1", self.port


@pytest.mark.usefixtures("fresh")
def test_an_ephemeral_range_from_1024_leaves_the_kernel_to_choose(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ephemeral(monkeypatch, tmp_path, "1024\t65535\n")
    monkeypatch.setattr(net.socket, "socket", FakeSocket)
    FakeSocket.offers = iter([5000, 5000, 5000, 5001])
    assert [net.free_port(), net.free_port()] == [5000, 5001]


def test_an_unreadable_range_is_linux_default(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setattr(net, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert net._ephemeral_low() == 32768
    ephemeral(monkeypatch, tmp_path, "garbage")
    assert net._ephemeral_low() == 32768
