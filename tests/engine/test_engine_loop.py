"""The continuous-batching loop: requests join and leave a running batch, cancellation frees."""

from __future__ import annotations

import threading
import time

import pytest

from python_backends.engine.engine_loop import EngineListener, EngineLoop, build_off_thread
from python_backends.engine.llm_engine import TokenEvent
from python_backends.engine.sequence import Sequence
from python_backends.params import SamplingParams
from tests.conftest import TinyModel, prompts


class Collector(EngineListener):
    def __init__(self, cancelled: set[str] | None = None) -> None:
        self.cancelled = cancelled if cancelled is not None else set()
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str | None] = {}
        self.done = threading.Condition()

    def on_tokens(self, events: list[TokenEvent]) -> None:
        with self.done:
            for ev in events:
                self.tokens.setdefault(ev.seq_id, []).append(ev.token_id)
                if ev.finish_reason:
                    self.finished[ev.seq_id] = ev.finish_reason.value
            self.done.notify_all()

    def on_finished_early(self, seq_id: str, error: Exception | None) -> None:
        with self.done:
            self.finished[seq_id] = str(error) if error else "cancelled"
            self.done.notify_all()

    def is_cancelled(self, seq_id: str) -> bool:
        return seq_id in self.cancelled

    def wait(self, n: int, timeout: float = 30.0) -> None:
        with self.done:
            assert self.done.wait_for(lambda: len(self.finished) >= n, timeout)


def test_requests_join_a_running_batch_and_match_hf(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine()
    c = Collector()
    loop = EngineLoop(engine, c)
    loop.start()
    try:
        batch = prompts(4, seed=20)
        loop.submit(Sequence("0", batch[0], SamplingParams(max_tokens=30)))
        time.sleep(0.05)  # the first is decoding when the others arrive
        for i, p in enumerate(batch[1:], start=1):
            loop.submit(Sequence(str(i), p, SamplingParams(max_tokens=10)))
        c.wait(4)
    finally:
        loop.stop()
    assert c.tokens["0"] == tiny_llama.greedy(batch[0], 30)
    for i, p in enumerate(batch[1:], start=1):
        assert c.tokens[str(i)] == tiny_llama.greedy(p, 10)
    assert engine.blocks.num_used == 0


def test_cancellation_and_refusal(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine(num_kv_blocks=16)
    cancelled: set[str] = set()
    c = Collector(cancelled)
    loop = EngineLoop(engine, c)
    loop.start()
    try:
        big = Sequence("big", list(range(1, 40)), SamplingParams(max_tokens=200))
        loop.submit(big)  # > 16 blocks
        # Each fits the 16 blocks alone (4 tokens a block); "b" may wait for "a"'s blocks.
        loop.submit(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=60)))
        loop.submit(Sequence("b", [4, 5, 6], SamplingParams(max_tokens=60)))
        with c.done:  # "a" is decoding (a fixed sleep let it finish on a busy machine)
            assert c.done.wait_for(lambda: "a" in c.tokens, 30), c.finished
        cancelled.add("a")
        loop.abort("b")
        c.wait(3)
    finally:
        loop.stop()
    assert "KV blocks" in str(c.finished["big"])
    assert c.finished["a"] == c.finished["b"] == "cancelled"
    assert engine.blocks.num_used == 0 and not engine.has_unfinished


def test_build_off_thread_builds_on_a_thread_that_is_gone_after() -> None:
    built_on: list[threading.Thread] = []

    def make() -> str:
        built_on.append(threading.current_thread())
        return "engine"

    assert build_off_thread(make) == "engine"
    assert built_on[0] is not threading.current_thread()
    assert not built_on[0].is_alive()  # its OpenMP team went with it


def test_build_off_thread_raises_the_builders_error_on_the_caller() -> None:
    def make() -> None:
        raise ValueError("no such engine")

    with pytest.raises(ValueError, match="no such engine"):
        build_off_thread(make)
