"""The ensemble's input tensors, typed by the wire's declaration of each input; streams the
gateway breaks when their server has lost them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from python_backends.gateway.backends import Backend
from python_backends.gateway.config import BackendConfig
from python_backends.gateway.errors import ApiError
from python_backends.gateway.triton import Breaker, Piece, ensemble_inputs, stream
from python_backends.wire import FRONT_START_METRIC


def test_inputs_take_the_ensembles_types_and_shapes() -> None:
    tensors = {t.name(): t for t in ensemble_inputs(
        {"text_input": "Hi", "max_tokens": 3, "temperature": 0.5, "stream": True,
         "resume_ids": [5, 6, 7], "stop_words": ["a", "b"]})}
    assert {n: (t.datatype(), t.shape()) for n, t in tensors.items()} == {
        "text_input": ("BYTES", [1, 1]), "max_tokens": ("INT32", [1, 1]),
        "temperature": ("FP32", [1, 1]), "stream": ("BOOL", [1, 1]),
        "resume_ids": ("INT32", [1, 3]), "stop_words": ("BYTES", [1, 2])}


@pytest.mark.parametrize(("inputs", "field"), [
    ({"colour": "red"}, "colour"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"resume_ids": [1, "x"]}, "resume_ids"),
    ({"resume_ids": 3}, "resume_ids"),
    ({"resume_ids": [2**40]}, "resume_ids"),
])
def test_bad_values_are_refused_by_name(inputs: dict[str, object], field: str) -> None:
    with pytest.raises(ApiError) as e:
        ensemble_inputs(inputs)
    assert e.value.status == 400 and e.value.param == field


class SilentStream:
    """A gRPC stream whose server never answers (its front died): reading waits until the
    call is cancelled, which raises CancelledError in the reader, as grpc.aio does."""

    def __init__(self) -> None:
        self._cancelled = asyncio.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    def __aiter__(self) -> SilentStream:
        return self

    async def __anext__(self) -> Any:
        await self._cancelled.wait()
        raise asyncio.CancelledError


class SilentClient:
    def stream_infer(self, requests: Any, **kwargs: Any) -> SilentStream:
        return SilentStream()


async def _silent_reader(breaker: Breaker) -> asyncio.Task[list[Piece]]:
    """A task reading a stream whose server never answers, once the stream is open."""
    async def read() -> list[Piece]:
        return [p async for p in stream(SilentClient(), {"text_input": "x"}, {}, None, 60.0,
                                        breaker)]

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.05)
    return reader


def test_a_stream_its_server_lost_ends_with_a_retryable_error() -> None:
    async def run() -> None:
        breaker = Breaker()
        reader = await _silent_reader(breaker)
        assert len(breaker) == 1
        assert breaker.break_all("its front restarted") == 1
        with pytest.raises(ApiError) as e:
            await asyncio.wait_for(reader, 5)
        assert e.value.retryable and "its front restarted" in e.value.message
        assert len(breaker) == 0

    asyncio.run(run())


def test_a_reader_that_goes_away_is_cancelled_not_broken() -> None:
    async def run() -> None:
        breaker = Breaker()
        reader = await _silent_reader(breaker)
        reader.cancel()  # the client went away: not an error to move
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert len(breaker) == 0

    asyncio.run(run())


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_a_restarted_front_breaks_the_streams_opened_before_it() -> None:
    backend = Backend(BackendConfig(name="a", grpc="127.0.0.1:1", metrics="http://x"))
    old, new = FakeCall(), FakeCall()
    backend.breaker.add(old)
    backend.metrics = {FRONT_START_METRIC: {frozenset(): time.time() - 60}}
    backend._watch_front()  # the front the gateway first saw: nothing to break
    assert not old.cancelled
    restart = time.time()
    time.sleep(0.01)
    backend.breaker.add(new)  # opened after the new front started
    backend.metrics = {FRONT_START_METRIC: {frozenset(): restart}}
    backend._watch_front()
    assert old.cancelled and not new.cancelled
    broken = backend.breaker.discard(old)
    assert broken is not None and broken.server_ok and "its front restarted" in broken.message
    assert backend.breaker.discard(new) is None


def test_a_silent_server_breaks_only_the_streams_that_are_quiet_too() -> None:
    breaker = Breaker()
    quiet, talking = FakeCall(), FakeCall()
    breaker.add(quiet)
    breaker.add(talking)
    time.sleep(0.05)
    breaker.heard(talking)
    assert breaker.break_all("it has not answered for 3 s", quiet_s=0.04) == 1
    assert quiet.cancelled and not talking.cancelled and len(breaker) == 1
