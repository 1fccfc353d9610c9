"""KV handed between engines of different layouts (prefill TP=2 -> decode TP=1, the reverse,
and across pipeline stages) is re-sliced on the way, and the output equals Hugging Face's.
The transport is a plain copy between the engines' whole-model pools here (tests/kv_transfer
covers the transports; tests/e2e/test_parallel.py this through the server over NIXL)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from python_backends.config import ParallelLayout
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.sequence import Sequence
from python_backends.params import SamplingParams
from tests.conftest import make_tiny_llama, prompts
from tests.parallel.test_parallel_engine import SHAPE

N = 10


def slots(blocks: list[int] | tuple[int, ...], block_size: int) -> torch.Tensor:
    return (torch.tensor(blocks).unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)


def hand_over(prefill: LLMEngine, decode: LLMEngine, batch: list[list[int]]) -> list[list[int]]:
    for i, p in enumerate(batch):
        prefill.add_request(f"s{i}", p, SamplingParams(max_tokens=N), prefill_only=True)
    firsts = {}
    while prefill.has_unfinished:
        for ev in prefill.step():
            firsts[ev.seq_id] = ev
    bs = prefill.config.limits.block_size
    assert prefill.handoff.layout == decode.handoff.layout  # the whole-model layout on both sides
    outputs = {}
    for i, p in enumerate(batch):
        ev = firsts[f"s{i}"]
        assert ev.kv_blocks

        def pull(blocks: list[int], src: tuple[int, ...] = ev.kv_blocks) -> bool:
            src_kv = prefill.handoff.pool.index_select(2, slots(src, bs).to(prefill.device))
            decode.handoff.pool.index_copy_(2, slots(blocks, bs).to(decode.device),
                                            src_kv.to(decode.device))
            return True

        seq = Sequence(f"s{i}", p, SamplingParams(max_tokens=N))
        seq.continue_from([ev.token_id], [0.0])
        decode.handoff.add(seq, ev.kv_tokens, pull)
        outputs[f"s{i}"] = [ev.token_id]
    computed = decode.stats().num_prompt_tokens_computed
    while decode.has_unfinished:
        for ev in decode.step():
            outputs[ev.seq_id].append(ev.token_id)
    assert decode.stats().num_prompt_tokens_computed == computed  # no prompt recomputed
    for ev in firsts.values():
        assert ev.kv_blocks
        prefill.blocks.release(list(ev.kv_blocks))
    return [outputs[f"s{i}"] for i in range(len(batch))]


@pytest.mark.parametrize("prefill_layout,decode_layout", [
    (ParallelLayout(tp=2), ParallelLayout()),
    (ParallelLayout(), ParallelLayout(tp=2)),
    (ParallelLayout(pp=2), ParallelLayout()),
    (ParallelLayout(), ParallelLayout(tp=2, pp=2)),
], ids=["tp2-to-tp1", "tp1-to-tp2", "pp2-to-tp1", "tp1-to-tp2pp2"])
def test_handoff_across_layouts_matches_hf(tmp_path: Path, prefill_layout: ParallelLayout,
                                           decode_layout: ParallelLayout) -> None:
    a = make_tiny_llama(tmp_path / "a", seed=51, parallel=prefill_layout, **SHAPE)
    b = make_tiny_llama(tmp_path / "b", seed=51, parallel=decode_layout, **SHAPE)
    batch = [[t % 250 for t in p] for p in prompts(4, seed=52, lo=5, hi=40)]
    prefill, decode = a.engine(), b.engine()
    try:
        assert hand_over(prefill, decode, batch) == [a.greedy(p, N) for p in batch]
        assert prefill.blocks.num_used == 0 and decode.blocks.num_used == 0
    finally:
        prefill.close()
        decode.close()
