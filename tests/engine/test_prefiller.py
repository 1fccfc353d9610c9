"""Prefill instance -> KV handle -> decode engine, in one process over real transports, against
Hugging Face greedy output."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.prefiller import Prefiller, PrefillJob, PrefillResult
from python_backends.engine.sequence import Sequence
from python_backends.flag_board import BoardCache
from python_backends.kv_transfer import nixl
from python_backends.kv_transfer.base import KVHandle, KVSink, TransferError
from python_backends.kv_transfer.host_shm import HostShmSink, HostShmSource, SharedPool
from python_backends.params import SamplingParams
from tests.conftest import TinyModel, prompts

TRANSPORTS = ["host_shm", "nixl"] if nixl.available() else ["host_shm"]
N_OUT = 12


@pytest.fixture(scope="module")
def prefill(tiny_llama: TinyModel) -> Iterator[Prefiller]:
    shared: list[SharedPool] = []

    def pool(layout: Any, device: Any) -> Any:
        shared.append(SharedPool.create(layout))
        return shared[0].tensor

    engine = tiny_llama.engine(num_kv_blocks=96, kv_pool=pool)
    sources: dict[str, Any] = {"host_shm": HostShmSource(shared[0].name)}
    if "nixl" in TRANSPORTS:
        sources["nixl"] = nixl.NixlSource(engine.handoff.pool, nixl.agent_name("prefill"))
    prefiller = Prefiller(engine, sources, owner="prefill-0", lease_s=20.0)
    prefiller.start()
    yield prefiller
    prefiller.close()
    shared[0].close()


@pytest.fixture(scope="module")
def decode(tiny_llama: TinyModel) -> Iterator[tuple[LLMEngine, dict[str, KVSink]]]:
    engine = tiny_llama.engine(num_kv_blocks=80)
    boards = BoardCache()
    layout = engine.handoff.layout
    sinks: dict[str, KVSink] = {"host_shm": HostShmSink(layout, engine.handoff.pool, boards)}
    if "nixl" in TRANSPORTS:
        sinks["nixl"] = nixl.NixlSink(layout, engine.handoff.pool, nixl.agent_name("decode"),
                                      boards)
    yield engine, sinks
    for sink in sinks.values():
        sink.close()
    boards.close()


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=N_OUT)


def _continue(
    engine: LLMEngine, sinks: dict[str, KVSink], results: list[PrefillResult],
    batch: list[list[int]], salt: str = "",
) -> tuple[dict[str, list[int]], list[str]]:
    """Hand each result to the decode engine and run it to completion (`salt`: the sequences'
    prefix-cache salt)."""
    outputs: dict[str, list[int]] = {}
    failures: list[str] = []

    def puller(handle: KVHandle) -> Any:
        def pull(blocks: list[int]) -> bool:
            sink = sinks[handle.transport]
            try:
                sink.pull(handle, blocks)
                return True
            except TransferError as e:
                failures.append(e.kind.value)
                sink.abandon(handle)
                return False
        return pull

    for i, (res, prompt) in enumerate(zip(results, batch, strict=True)):
        assert res.handle is not None and res.finish_reason is None
        outputs[f"s{i}"] = [res.token_id]
        seq = Sequence(f"s{i}", prompt, _params(), cache_salt=salt)
        seq.continue_from([res.token_id], [res.logprob])
        engine.handoff.add(seq, res.handle.num_tokens, puller(res.handle))
    while engine.has_unfinished:
        for ev in engine.step():
            outputs[ev.seq_id].append(ev.token_id)
        for sink in sinks.values():  # as the decode model does after each step
            sink.flush()
    return outputs, failures


def _wait_released(prefiller: Prefiller) -> None:
    deadline = time.monotonic() + 10
    while prefiller.engine.blocks.num_used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefiller.engine.blocks.num_used == 0 and len(prefiller.leases) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_handoff_matches_hf_and_decode_computes_no_prompt(
    tiny_llama: TinyModel, prefill: Prefiller, decode: Any, transport: str
) -> None:
    engine, sinks = decode
    batch = prompts(5, seed=3, lo=5, hi=60)
    results = prefill.prefill([PrefillJob(p, _params(), transport) for p in batch])
    before = engine.stats().num_prompt_tokens_computed
    outputs, failures = _continue(engine, sinks, results, batch)  # type: ignore[arg-type]
    assert failures == []
    assert engine.stats().num_prompt_tokens_computed == before  # all prompt KV came over
    for i, prompt in enumerate(batch):
        assert outputs[f"s{i}"] == tiny_llama.greedy(prompt, N_OUT), i
    assert engine.blocks.num_used == 0
    _wait_released(prefill)


@pytest.mark.parametrize("fault", ["transfer_error", "expire_lease"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_failed_handoff_recomputes(
    tiny_llama: TinyModel, prefill: Prefiller, decode: Any, transport: str, fault: str
) -> None:
    engine, sinks = decode
    batch = prompts(2, seed=12, lo=20, hi=40)
    expired_before = prefill.num_expired
    results = prefill.prefill([PrefillJob(p, _params(), transport, fault) for p in batch])
    before = engine.stats().num_prompt_tokens_computed
    # A salt of its own: decode recomputes with a cold cache, whatever earlier cases computed.
    outputs, failures = _continue(engine, sinks, results, batch,  # type: ignore[arg-type]
                                  salt=f"{transport}-{fault}")
    assert failures == [{"transfer_error": "error", "expire_lease": "expired"}[fault]] * 2
    assert engine.stats().num_prompt_tokens_computed - before == sum(map(len, batch))
    for i, prompt in enumerate(batch):
        assert outputs[f"s{i}"] == tiny_llama.greedy(prompt, N_OUT), i
    _wait_released(prefill)
    if fault == "expire_lease":
        assert prefill.num_expired == expired_before + 2


def test_unreleased_lease_expires(tiny_llama: TinyModel, prefill: Prefiller) -> None:
    prefill.lease_s = 0.2
    try:
        [res] = prefill.prefill([PrefillJob(prompts(1, seed=13)[0], _params())])
    finally:
        prefill.lease_s = 20.0
    assert isinstance(res, PrefillResult) and res.handle is not None
    assert prefill.engine.blocks.num_used == len(res.handle.block_ids) > 0
    expired = prefill.num_expired
    _wait_released(prefill)  # nobody pulls: the reaper frees the blocks at the deadline
    assert prefill.num_expired == expired + 1


def test_first_token_can_finish_the_request(prefill: Prefiller) -> None:
    [res] = prefill.prefill([PrefillJob([5, 6, 7], SamplingParams(max_tokens=1))])
    assert isinstance(res, PrefillResult)
    assert res.handle is None and res.finish_reason is not None
    assert prefill.engine.blocks.num_used == 0
    [bad] = prefill.prefill([PrefillJob([5, 6], _params(), transport="carrier_pigeon")])
    assert isinstance(bad, ValueError) and "carrier_pigeon" in str(bad)


def test_results_come_as_each_prompt_finishes(prefill: Prefiller) -> None:
    """Prompts share one continuous batch: the first one's result does not wait for the last."""
    order: list[int] = []
    busy_at_first: list[bool] = []
    finished = threading.Semaphore(0)

    def done(i: int, result: Any) -> None:  # on the loop thread, between steps
        assert isinstance(result, PrefillResult)
        if not order:
            busy_at_first.append(prefill.engine.has_unfinished)
        order.append(i)
        finished.release()

    # 3 x 120 tokens with a 256-token step budget: two finish in the first step, one later.
    # Hold the loop until all three are queued, so they share the first step.
    go = threading.Event()
    def hold(_engine: LLMEngine) -> None:
        go.wait(10)

    prefill.loop.call(hold)
    for i, prompt in enumerate(prompts(3, seed=14, lo=120, hi=121)):
        prefill.submit(PrefillJob(prompt, _params()), partial(done, i))
    go.set()
    for _ in range(3):
        assert finished.acquire(timeout=60)
    assert order == [0, 1, 2]
    assert busy_at_first == [True]  # the third prompt was still computing
    _wait_released_or_expire(prefill)


def _wait_released_or_expire(prefiller: Prefiller) -> None:
    """Leases nobody will pull: release them as a front does when its client cancels."""
    with prefiller._leases_lock:
        for ticket in list(prefiller.leases._leases):
            prefiller.board.cancel(ticket)
    _wait_released(prefiller)


def test_blocks_a_stuck_copy_may_still_write_are_never_reused(tiny_llama: TinyModel) -> None:
    """A pull that raises BlocksInDoubt (a NIXL READ that outlived its cancellation): the
    sequence is recomputed in other blocks, and the doubtful ones stay allocated for good."""
    from python_backends.engine.kv_handoff import BlocksInDoubt

    engine = tiny_llama.engine()
    prompt = prompts(1, seed=21, lo=20, hi=30)[0]
    doubtful: list[int] = []

    def stuck(blocks: list[int]) -> bool:
        doubtful.extend(blocks)
        raise BlocksInDoubt("a READ still running after its cancellation")

    seq = Sequence("s", prompt, _params())
    seq.continue_from([tiny_llama.greedy(prompt, 1)[0]], [0.0])
    engine.handoff.add(seq, len(prompt), stuck)
    out = [seq.output_ids[0]]
    while engine.has_unfinished:
        out += [ev.token_id for ev in engine.step()]
        assert not set(seq.block_table) & set(doubtful)
    assert out == tiny_llama.greedy(prompt, N_OUT)
    assert doubtful and engine.handoff.quarantined == doubtful
    assert engine.blocks.num_used == len(doubtful)  # held for the engine's life
