"""The gateway's SSE response: its events in order; a client that goes away, between events or
while one is being written, ends the iterator (its cleanup runs: the gateway counts the
request and cancels it on the server) and leaves the server's task as it was."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from python_backends.gateway.sse import EventStream


class Client:
    """ASGI receive and send for one response; `leave()` disconnects it."""

    def __init__(self, slow_send: bool = False) -> None:
        self.sent: list[MutableMapping[str, Any]] = []
        self._left = asyncio.Event()
        self._slow_send = slow_send

    def leave(self) -> None:
        self._left.set()

    async def receive(self) -> dict[str, Any]:
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)
        if self._slow_send and message.get("body"):
            await asyncio.sleep(3600)  # a client that stopped reading

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


class Events:
    def __init__(self, n: int, pause_s: float = 0.0) -> None:
        self.n, self.pause_s = n, pause_s
        self.ended: str | None = None  # how the iterator ended

    async def __call__(self) -> AsyncIterator[str]:
        try:
            for i in range(self.n):
                yield f"data: {i}\n\n"
                await asyncio.sleep(self.pause_s)
            self.ended = "done"
        except (GeneratorExit, asyncio.CancelledError) as e:
            self.ended = type(e).__name__
            raise


def _respond(client: Client, events: Events, leave_after_s: float | None) -> int:
    """Run the response in a task as the server would; returns how many cancellations the
    task is left with."""
    async def run() -> int:
        async def serve() -> int:
            await EventStream(events())({"type": "http"}, client.receive, client.send)
            task = asyncio.current_task()
            assert task is not None
            return task.cancelling()

        task = asyncio.create_task(serve())
        if leave_after_s is not None:
            await asyncio.sleep(leave_after_s)
            client.leave()
        return await asyncio.wait_for(task, 5)

    return asyncio.run(run())


def test_the_events_go_out_in_order_then_the_end() -> None:
    client, events = Client(), Events(3)
    assert _respond(client, events, None) == 0
    assert client.sent[0]["type"] == "http.response.start" and client.sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in client.sent[0]["headers"]
    assert client.bodies() == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert client.sent[-1]["more_body"] is False and events.ended == "done"


def test_a_client_that_leaves_between_events_ends_the_iterator() -> None:
    client, events = Client(), Events(1000, pause_s=0.01)
    assert _respond(client, events, leave_after_s=0.05) == 0
    assert events.ended == "CancelledError"
    assert 1 < len(client.bodies()) < 1000 and client.bodies()[-1] != b""


def test_a_client_that_leaves_while_an_event_is_written_ends_the_iterator() -> None:
    client, events = Client(slow_send=True), Events(1000)
    assert _respond(client, events, leave_after_s=0.05) == 0
    assert events.ended == "GeneratorExit" and client.bodies() == [b"data: 0\n\n"]


def test_a_disconnect_after_the_end_cancels_nothing() -> None:
    async def run() -> tuple[int, int, bool]:
        client = Client()
        await EventStream(Events(2)())({"type": "http"}, client.receive, client.send)
        client.leave()
        slept = False
        try:
            await asyncio.sleep(0.05)  # a cancellation would land in this sleep
            slept = True
        except asyncio.CancelledError:
            pass
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling(), len(asyncio.all_tasks()), slept

    cancelling, tasks, slept = asyncio.run(run())
    assert (cancelling, tasks, slept) == (0, 1, True)  # no watcher outlived the response
