"""Prefix caching: greedy output is the same with caching on and off, and equal to Hugging
Face's, while cached prefixes are not computed again; salts isolate; the KV store behind the
pool serves prefixes another engine computed or the pool evicted."""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from python_backends.config import EngineLimits, ParallelLayout
from python_backends.engine.llm_engine import EngineStats, LLMEngine, TierFactory
from python_backends.engine.sequence import Sequence
from python_backends.kv_store.host_store import STORE_PREFIX, HostKVStore
from python_backends.kv_store.tier import StoreTier
from python_backends.kv_transfer.layout import KVLayout
from python_backends.params import SamplingParams
from tests.conftest import TinyModel, make_tiny_llama, prompts
from tests.parallel.test_parallel_engine import SHAPE

BS = 4  # the tiny engines' block size


def generate(engine: LLMEngine, batch: list[list[int]], n: int | list[int],
             salt: str = "") -> list[list[int]]:
    """Run `batch` together to the end; every block is free afterwards."""
    lengths = n if isinstance(n, list) else [n] * len(batch)
    ids = [uuid.uuid4().hex for _ in batch]
    for seq_id, p, k in zip(ids, batch, lengths, strict=True):
        engine.add(Sequence(seq_id, list(p), SamplingParams(max_tokens=k), cache_salt=salt))
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
    assert engine.blocks.num_used == 0  # no block held by a finished sequence
    return [out[i] for i in ids]


def delta(after: EngineStats, before: EngineStats, name: str) -> int:
    return int(getattr(after, name) - getattr(before, name))


def test_repeated_prompt_computes_only_its_last_block(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine()
    p = prompts(1, seed=30, lo=30, hi=31)[0]  # 30 tokens: 7 full blocks and 2 tokens
    want = [tiny_llama.greedy(p, 8)]
    assert generate(engine, [p], 8) == want
    before = engine.stats()
    assert generate(engine, [p], 8) == want
    after = engine.stats()
    assert delta(after, before, "prefix_cache_queries") == len(p)
    assert delta(after, before, "prefix_cache_hits") == 28
    assert delta(after, before, "num_prompt_tokens_computed") == 2


def test_a_fully_cached_prompt_recomputes_its_last_block(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine()
    p = prompts(1, seed=31, lo=24, hi=25)[0]  # exactly 6 blocks
    generate(engine, [p], 4)
    before = engine.stats()
    assert generate(engine, [p], 4) == [tiny_llama.greedy(p, 4)]
    assert delta(engine.stats(), before, "num_prompt_tokens_computed") == BS  # its logits


def test_shared_partial_block_and_prefix_of_another(tiny_llama: TinyModel) -> None:
    base = prompts(1, seed=32, lo=22, hi=23)[0]  # 5 full blocks + 2 tokens
    variants = [base, base[:10], [*base, 5, 6, 7], [*base[:13], 9, 9], base[:8]]
    on, off = tiny_llama.engine(), tiny_llama.engine(enable_prefix_caching=False)
    for p in variants:
        want = [tiny_llama.greedy(p, 6)]
        assert generate(on, [p], 6) == generate(off, [p], 6) == want
    assert on.stats().prefix_cache_hits > 0 and off.stats().prefix_cache_hits == 0
    assert on.stats().num_prompt_tokens_computed < off.stats().num_prompt_tokens_computed


def test_chunked_prefill_over_a_cached_prefix(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine()
    engine.scheduler.limits = EngineLimits(max_seq_len=256, max_num_seqs=16,
                                           max_num_batched_tokens=7, block_size=BS)
    base = prompts(1, seed=33, lo=30, hi=31)[0]
    longer = [base + prompts(1, seed=34, lo=25, hi=26)[0], [*base, 1, 2, 3]]
    generate(engine, [base], 4)
    before = engine.stats()
    assert generate(engine, longer, 8) == [tiny_llama.greedy(p, 8) for p in longer]
    assert delta(engine.stats(), before, "prefix_cache_hits") == 2 * 28


def test_preempted_sequences_hit_their_own_blocks(tiny_llama: TinyModel) -> None:
    batch = prompts(6, seed=35, lo=10, hi=20)
    engine = tiny_llama.engine(num_kv_blocks=24)  # far fewer than the batch needs
    assert generate(engine, batch, 24) == [tiny_llama.greedy(p, 24) for p in batch]
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_salts_isolate(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine()
    p = prompts(1, seed=36, lo=20, hi=21)[0]
    generate(engine, [p], 2, salt="tenant-a")
    before = engine.stats()
    generate(engine, [p], 2, salt="tenant-b")
    assert delta(engine.stats(), before, "prefix_cache_hits") == 0
    generate(engine, [p], 2, salt="tenant-a")
    assert delta(engine.stats(), before, "prefix_cache_hits") == 16


def test_randomized_shared_prefixes_on_a_small_pool(tiny_llama: TinyModel) -> None:
    """Hundreds of requests sharing a few system prompts, a pool where eviction never stops:
    each output equals its own Hugging Face reference. (Seeds whose requests have no near-tie
    between two logits: batching alone flips one in a few hundred other requests, cache or
    no cache.)"""
    rng = random.Random(44)
    systems = prompts(4, seed=45, lo=8, hi=40)
    requests = [(rng.choice(systems) + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 16))],
                 rng.randrange(1, 9)) for _ in range(240)]
    engine = tiny_llama.engine(num_kv_blocks=48)
    references: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for start in range(0, len(requests), 12):
        wave = requests[start:start + 12]
        outputs = generate(engine, [p for p, _ in wave], [n for _, n in wave])
        for (p, n), out in zip(wave, outputs, strict=True):
            key = (tuple(p), n)
            if key not in references:
                references[key] = tiny_llama.greedy(p, n)
            assert out == references[key], key
    stats = engine.stats()
    assert stats.prefix_cache_hits > stats.prefix_cache_queries // 4
    assert engine.blocks.num_evictions > 0 and engine.blocks.num_used == 0


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2), ParallelLayout(pp=2)],
                         ids=["tp2", "pp2"])
def test_parallel_engines_cache(tmp_path: Path, layout: ParallelLayout) -> None:
    model = make_tiny_llama(tmp_path / "engine", parallel=layout, **SHAPE)
    engine = model.engine()
    try:
        base = [t % 250 for t in prompts(1, seed=39, lo=26, hi=27)[0]]
        batch = [[*base, 1, 2], [*base, 3], base]
        want = [model.greedy(p, 8) for p in batch]
        assert generate(engine, [batch[0]], 8) == want[:1]
        assert generate(engine, batch[1:], 8) == want[1:]
        assert engine.stats().prefix_cache_hits == 2 * 24
    finally:
        engine.close()


@pytest.fixture
def store(tiny_llama: TinyModel) -> Iterator[HostKVStore]:
    engine = tiny_llama.engine(num_kv_blocks=4)
    layout = dataclasses.replace(engine.handoff.layout, num_blocks=64)
    s = HostKVStore.create(f"{STORE_PREFIX}test_{uuid.uuid4().hex[:8]}", layout)
    yield s
    s.close()


def with_store(name: str) -> TierFactory:
    def make(pool: torch.Tensor, layout: KVLayout) -> StoreTier:
        return StoreTier(lambda: name, pool, layout)
    return make


def test_a_prefix_computed_by_one_engine_is_read_by_another(
    tiny_llama: TinyModel, store: HostKVStore
) -> None:
    a = tiny_llama.engine(kv_tier=with_store(store.name))
    b = tiny_llama.engine(kv_tier=with_store(store.name))
    p = prompts(1, seed=40, lo=33, hi=34)[0]  # 8 full blocks and 1 token
    want = [tiny_llama.greedy(p, 6)]
    assert generate(a, [p], 6) == want
    assert generate(b, [p], 6) == want
    stats = b.stats()
    assert stats.kv_store_hits == 8 and stats.prefix_cache_hits == 32
    assert stats.num_prompt_tokens_computed == 1  # only the rest
    assert stats.kv_store_read_bytes == 8 * b.handoff.layout.bytes_for(1)
    assert a.stats().kv_store_written_bytes > 0
    a.close()
    b.close()


def test_a_prefix_the_pool_evicted_comes_back_from_the_store(
    tiny_llama: TinyModel, store: HostKVStore
) -> None:
    engine = tiny_llama.engine(num_kv_blocks=24, kv_tier=with_store(store.name))
    p, *others = prompts(4, seed=41, lo=40, hi=41)
    want = tiny_llama.greedy(p, 4)
    assert generate(engine, [p], 4) == [want]
    for other in others:  # each needs 11 of the 24 blocks: p's are evicted
        generate(engine, [other], 4)
    assert engine.blocks.lookup(*_first_block(engine, p)) is None
    before = engine.stats()
    assert generate(engine, [p], 4) == [want]
    assert delta(engine.stats(), before, "kv_store_hits") == 9
    engine.close()


def _first_block(engine: LLMEngine, p: list[int]) -> tuple[int, list[int]]:
    seq = Sequence("probe", p, SamplingParams(max_tokens=1))
    return seq.block_hashes(BS, 1)[0], p[:BS]


def test_without_a_store_the_engine_computes(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine(kv_tier=with_store(f"{STORE_PREFIX}absent"))
    p = prompts(1, seed=42, lo=20, hi=21)[0]
    assert generate(engine, [p], 4) == [tiny_llama.greedy(p, 4)]
    assert engine.stats().kv_store_hits == 0
    engine.close()
