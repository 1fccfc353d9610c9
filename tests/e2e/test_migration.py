"""Requests survive a dying engine: with 8 streams in flight, the worker, decode or prefill stub
is killed (or a rank of a tensor-parallel worker); every stream completes with Hugging Face's
greedy output on a live engine, or ends with a clear error within 5 s when none is left, and
no KV block stays held."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from python_backends.bench.client import GenerateError, LLMClient, as_list
from python_backends.config import ParallelLayout
from python_backends.engine.builder import reshard_engine
from python_backends.metrics_text import metric_sum
from tests.e2e.conftest import (
    ENGINE_DIR,
    KILLED_BY_TESTS,
    KILLS_STUBS,
    PROMPTS,
    Reference,
    Server,
    hf_greedy,
    only_stub,
    wait_restarted,
)
from tests.e2e.test_parallel import expect_ranks, rank_pids, worker_serving

pytestmark = [pytest.mark.e2e, KILLS_STUBS]
STREAMS = [*PROMPTS, "Write a short poem about the sea.", "List the planets of the solar system:"]
LONG = 64  # tokens per stream: the kill lands mid-stream
FILLER = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)  # ~400 tokens
PREFILLS = [f"{p}\n{FILLER}" for p in STREAMS]  # no shared prefix: each is computed


@pytest.fixture(scope="module")
def long_reference() -> Reference:
    return hf_greedy(STREAMS, LONG)


class Streams:
    """Greedy streams in flight at once, each on its own thread and connection."""

    def __init__(self, server: Server, prompts: list[str], **inputs: Any) -> None:
        self.client = LLMClient(server.options.http_url, timeout=120)
        self.ids: list[list[int]] = [[] for _ in prompts]
        self.errors: list[str | None] = [None] * len(prompts)
        self.ended = [0.0] * len(prompts)
        self.threads = [threading.Thread(target=self._run, args=(i, p, inputs))
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _run(self, i: int, prompt: str, inputs: dict[str, Any]) -> None:
        try:
            for event in self.client.stream(prompt, exclude_input_in_output=True, **inputs):
                self.ids[i].extend(as_list(event.get("output_ids", [])))
        except GenerateError as e:
            self.errors[i] = e.message
        finally:
            self.ended[i] = time.monotonic()

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        """Until every stream has `n` tokens or has ended (a short answer)."""
        deadline = time.monotonic() + timeout
        while any(len(ids) < n and not self.ended[i] for i, ids in enumerate(self.ids)):
            assert time.monotonic() < deadline, [len(ids) for ids in self.ids]
            time.sleep(0.02)

    def join(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a stream hung"


def kill_stub(server: Server, model: str) -> int:
    stub = only_stub(server, model)
    KILLED_BY_TESTS.add(stub.instance)
    os.kill(stub.pid, signal.SIGKILL)
    return stub.pid


def migrations(server: Server) -> float:
    return metric_sum(server.metrics(), "llm_request_migrations_total")


@pytest.mark.parametrize(("model", "route"), [("worker", "aggregated"),
                                              ("decode", "disaggregated")])
def test_streams_survive_their_engine_dying(
    server: Server, long_reference: Reference, model: str, route: str
) -> None:
    before = migrations(server)
    streams = Streams(server, STREAMS, max_tokens=LONG, route=route)
    streams.wait_tokens(4)
    dead = kill_stub(server, model)
    streams.join()
    assert streams.errors == [None] * len(STREAMS)
    for prompt, ids in zip(STREAMS, streams.ids, strict=True):
        assert ids == long_reference.outputs[prompt], prompt  # no gap, no duplicate
    moved = migrations(server) - before
    assert 1 <= moved <= len(STREAMS)
    print(f"{model} killed: {moved:.0f} streams moved, all {len(STREAMS)} HF-equal")
    wait_restarted(server, model, dead)
    assert server.wait_idle(timeout=30) == 0


def test_prefills_in_flight_survive_the_prefill_engine_dying(server: Server) -> None:
    """The prefill stub dies with long prompts in its batch: decode computes them instead."""
    reference = hf_greedy(PREFILLS, 8)
    before = migrations(server)
    streams = Streams(server, PREFILLS, max_tokens=8, route="disaggregated")
    time.sleep(0.3)  # 8 x 400 prompt tokens: the prefill group is busy for seconds
    dead = kill_stub(server, "prefill")
    streams.join()
    assert streams.errors == [None] * len(PREFILLS)
    assert streams.ids == [reference.outputs[p] for p in PREFILLS]
    assert migrations(server) > before  # at least one prefill was lost in flight
    wait_restarted(server, "prefill", dead)
    assert server.wait_idle(timeout=30) == 0


def test_streams_end_with_a_clear_error_when_no_engine_is_left(server: Server) -> None:
    unserved = metric_sum(server.metrics(), "llm_requests_unserved_total")
    streams = Streams(server, STREAMS, max_tokens=LONG * 4, route="aggregated", end_id=-1)
    streams.wait_tokens(4)
    killed_at = time.monotonic()
    dead = {model: kill_stub(server, model) for model in ("worker", "decode")}
    streams.join()
    for error, ended in zip(streams.errors, streams.ended, strict=True):
        assert error is not None and "no engine instance is left" in error, error
        assert ended - killed_at < 5.0
    assert metric_sum(server.metrics(), "llm_requests_unserved_total") - unserved == 8
    for model, pid in dead.items():
        wait_restarted(server, model, pid)
    assert server.wait_idle(timeout=30) == 0


def test_streams_survive_a_dead_rank_of_a_tensor_parallel_worker(
    server: Server, long_reference: Reference, tmp_path: Path
) -> None:
    """SmolLM2 has 3 KV heads, so its tensor-parallel split is TP3. A rank dies: the engine
    fails its sequences as unavailable, the front moves them to decode, and the broken
    instance exits so that the watchdog restarts it."""
    engine = tmp_path / "tp3"
    reshard_engine(ENGINE_DIR, engine, ParallelLayout(tp=3), log=lambda _m: None)
    with worker_serving(server, engine):
        ranks = expect_ranks(2)
        stub = only_stub(server, "worker")  # the old version's may still be stopping
        KILLED_BY_TESTS.add(stub.instance)
        streams = Streams(server, STREAMS, max_tokens=LONG, route="aggregated")
        streams.wait_tokens(4)
        os.kill(sorted(ranks)[0], signal.SIGKILL)
        streams.join()
        assert streams.errors == [None] * len(STREAMS)
        for prompt, ids in zip(STREAMS, streams.ids, strict=True):
            assert ids == long_reference.outputs[prompt], prompt
        wait_restarted(server, "worker", stub.pid)
        assert "a rank of the engine died; exiting" in server.log_file.read_text()
    expect_ranks(0)
    assert not rank_pids()
    assert server.wait_idle(timeout=30) == 0
