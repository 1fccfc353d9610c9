"""Remote engine groups: which server a call goes to, servers that go down and come back, DNS
names re-resolved, and a call to a server that is not there."""

from __future__ import annotations

import pytest

from python_backends.front.channel import Reply
from python_backends.front.remote import RemoteCall, RemoteGroup, ServerSet
from python_backends.net import free_port
from tests.conftest import Clock


def test_calls_go_to_the_server_with_fewest_in_flight_in_turn() -> None:
    servers = ServerSet("a:1, b:2")
    first, second = servers.pick(), servers.pick()
    assert {first, second} == {"a:1", "b:2"}
    assert first is not None
    servers.done(first)
    assert servers.pick() == first  # the other one is still busy
    servers.done(first)
    assert second is not None
    servers.done(second)
    picks = [servers.pick() for _ in range(4)]
    for p in picks:
        assert p is not None
        servers.done(p)
    assert picks[0] != picks[1] and picks[1] != picks[2]  # idle servers take turns


def test_a_server_marked_down_is_left_out_for_a_while() -> None:
    clock = Clock()
    servers = ServerSet("a:1,b:2", down_for_s=5.0, clock=clock)
    servers.mark_down("a:1")
    assert servers.up() == ["b:2"]
    servers.mark_down("b:2")
    assert servers.pick() is None
    clock.t = 5.0
    assert servers.up() == ["a:1", "b:2"]


def test_a_dns_name_is_resolved_again_and_a_failed_lookup_keeps_the_last_answer() -> None:
    clock = Clock()
    answers: list[list[str] | OSError] = [["10.0.0.1:8001"], ["10.0.0.1:8001", "10.0.0.2:8001"],
                                          OSError("no DNS")]
    looked_up: list[tuple[str, int]] = []

    def resolver(name: str, port: int) -> list[str]:
        looked_up.append((name, port))
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    servers = ServerSet("dns:decode.llm.svc:8001", resolve_every_s=10.0, clock=clock,
                        resolver=resolver)
    assert servers.addresses() == ["10.0.0.1:8001"]
    assert servers.addresses() == ["10.0.0.1:8001"] and len(looked_up) == 1  # still fresh
    clock.t = 10.0
    assert servers.addresses() == ["10.0.0.1:8001", "10.0.0.2:8001"]
    clock.t = 20.0
    assert servers.addresses() == ["10.0.0.1:8001", "10.0.0.2:8001"]
    assert looked_up == [("decode.llm.svc", 8001)] * 3


@pytest.mark.parametrize("spec", ["", "a", "a:b", "dns:decode", "dns::80", "a:1,b"])
def test_bad_server_lists_are_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="expected"):
        ServerSet(spec)


def _drain(call: RemoteCall) -> list[Reply]:
    replies = []
    while (reply := call.next(timeout=10)) is not RemoteCall.END:
        replies.append(reply)
    return replies


def test_a_call_to_a_server_that_is_not_there_ends_unavailable_and_marks_it_down() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    group = RemoteGroup("decode", ServerSet(address))
    [reply] = _drain(group.call({}, ["OUTPUT_IDS"]))
    assert reply.unavailable and address in reply.error and "UNAVAILABLE" in reply.error
    assert not group.live()
    [reply] = _drain(group.call({}, ["OUTPUT_IDS"]))  # no server left: at once
    assert reply.unavailable and "no server of the group is up" in reply.error
    group.close()
