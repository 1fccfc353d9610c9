"""The development cluster's plan: roles, ports and the front's remote groups."""

from __future__ import annotations

import itertools

import pytest

from python_backends.ops.cluster import ClusterPlan
from python_backends.ops.launcher import ServerError


def test_engine_servers_first_then_a_front_calling_them() -> None:
    servers = ClusterPlan(prefill=2, decode=1, base_port=8100).servers()
    assert [s.role for s in servers] == ["prefill", "prefill", "decode", "front"]
    front = servers[-1]
    assert (front.http_port, front.grpc_port, front.metrics_port) == (8100, 8101, 8102)
    assert [s.http_port for s in servers[:-1]] == [8103, 8106, 8109]
    assert dict(front.remote_groups) == {"prefill": "127.0.0.1:8104,127.0.0.1:8107",
                                         "decode": "127.0.0.1:8110"}
    assert all(not s.remote_groups for s in servers[:-1])


def test_ports_can_come_from_elsewhere() -> None:
    ports = itertools.count(20000, 7)
    servers = ClusterPlan(prefill=0, decode=0, worker=1).servers(ports=lambda: next(ports))
    assert [(s.role, s.http_port) for s in servers] == [("worker", 20021), ("front", 20000)]
    assert dict(servers[-1].remote_groups) == {"worker": "127.0.0.1:20028"}


@pytest.mark.parametrize(("prefill", "decode", "message"), [
    (1, 0, "needs both --prefill and --decode"),
    (0, 0, "no engine server"),
    (-1, 1, "cannot be negative"),
])
def test_plans_that_cannot_serve_are_refused(prefill: int, decode: int, message: str) -> None:
    with pytest.raises(ServerError, match=message):
        ClusterPlan(prefill=prefill, decode=decode)
