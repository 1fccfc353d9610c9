"""Engines split over tensor-parallel ranks and pipeline stages (real gloo process groups, one
process per rank) produce Hugging Face's greedy output token for token."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from python_backends import procfs
from python_backends.config import EngineConfig, EngineConfigError, EngineLimits, ParallelLayout
from python_backends.engine.builder import write_engine
from python_backends.engine.engine_loop import build_off_thread
from python_backends.engine.ranks import RankGroup
from python_backends.engine.speculative import SpeculationConfig
from python_backends.parallel.placement import Placement
from python_backends.params import SamplingParams
from tests.conftest import TinyModel, make_tiny_llama, prompts
from tests.engine.test_llm_engine import run_all
from tests.engine.test_speculative import events_until_done, with_oracle

# 8 query / 4 KV heads take tp 1, 2, 4; 3 layers take pp 2 (2 + 1 layers) and 3; a vocabulary
# of 250 does not divide by 3 or 4, so the vocab-parallel shards are padded.
SHAPE: dict[str, Any] = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=64,
                             vocab_size=250)


def children() -> set[int]:
    return {p.pid for p in procfs.running_children(os.getpid())}


def check_layout(model: TinyModel, n_prompts: int = 6, n_tokens: int = 12,
                 placement: Placement | None = None) -> None:
    """The engine's greedy output equals HF's, and no rank process outlives it. Built as the
    serving models build it: on a thread that ends once it is loaded (its ranks must live on)."""
    before = children()
    engine = build_off_thread(partial(model.engine, placement=placement))
    try:
        batch = prompts(n_prompts, seed=11, hi=30)
        batch = [[t % 250 for t in p] for p in batch]
        assert run_all(engine, batch, n_tokens) == [model.greedy(p, n_tokens) for p in batch]
    finally:
        engine.close()
    assert children() <= before, "rank processes left behind"


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (1, 2), (1, 3), (2, 2)])
def test_layout_matches_hf(tmp_path: Path, tp: int, pp: int) -> None:
    model = make_tiny_llama(tmp_path / "e", seed=21, parallel=ParallelLayout(tp=tp, pp=pp),
                            **SHAPE)
    check_layout(model)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tied_embeddings_split_match_hf(tmp_path: Path, tp: int, pp: int) -> None:
    model = make_tiny_llama(tmp_path / "e", seed=22, parallel=ParallelLayout(tp=tp, pp=pp),
                            tie_word_embeddings=True, **SHAPE)
    check_layout(model, n_prompts=3)


def test_drafts_over_tensor_and_pipeline_ranks_keep_hf_output(tmp_path: Path) -> None:
    """Speculative rows (engine.speculative) cross TP ranks and PP micro-batches like decodes."""
    model = make_tiny_llama(tmp_path / "e", seed=21, parallel=ParallelLayout(tp=2, pp=2),
                            **SHAPE)
    engine = build_off_thread(partial(model.engine, speculation=SpeculationConfig(4)))
    try:
        batch = [[t % 250 for t in p] for p in prompts(4, seed=11, hi=30)]  # check_layout's
        want = [model.greedy(p, 12) for p in batch]
        for i, p in enumerate(batch):
            with_oracle(engine, str(i), p, SamplingParams(max_tokens=12), want[i], wrong=i)
        got: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
        for ev in events_until_done(engine)[0]:
            got[ev.seq_id].append(ev.token_id)
        assert [got[str(i)] for i in range(len(batch))] == want
        stats = engine.stats()
        assert 0 < stats.draft_tokens_accepted < stats.draft_tokens
    finally:
        engine.close()


def test_each_rank_file_holds_only_its_shards(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "e", seed=23, parallel=ParallelLayout(tp=2, pp=3), **SHAPE)
    config = EngineConfig.load(tmp_path / "e")
    assert config.weight_files() == [f"rank{r}.safetensors" for r in range(6)]
    r0 = load_file(str(tmp_path / "e" / "rank0.safetensors"))
    r5 = load_file(str(tmp_path / "e" / "rank5.safetensors"))
    assert r0["model.embed_tokens.weight"].shape == (125, 64)  # half of the vocabulary
    assert r0["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 8, 64)  # 4 of 8 heads
    assert r0["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 64)  # 2 of 4 KV heads
    assert r0["model.layers.0.self_attn.o_proj.weight"].shape == (64, 4 * 8)
    assert not any(k.startswith("model.layers.1.") for k in r0)  # one layer per stage
    assert "lm_head.weight" not in r0 and "model.norm.weight" not in r0
    assert r5["lm_head.weight"].shape == (125, 64) and "model.embed_tokens.weight" not in r5


def test_builder_refuses_layouts_the_model_cannot_take(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**SHAPE, intermediate_size=128, num_hidden_layers=3))
    limits = make_limits()
    with pytest.raises(EngineConfigError, match=r"tp=3 does not divide the model's 4 KV heads"):
        write_engine(hf, None, tmp_path / "a", limits, "float32", "x",
                     parallel=ParallelLayout(tp=3))
    with pytest.raises(EngineConfigError, match=r"pp=4 exceeds the model's 3 layers"):
        write_engine(hf, None, tmp_path / "b", limits, "float32", "x",
                     parallel=ParallelLayout(pp=4))
    with pytest.raises(EngineConfigError, match=r"ep=2 needs a mixture-of-experts model"):
        write_engine(hf, None, tmp_path / "c", limits, "float32", "x",
                     parallel=ParallelLayout(ep=2))
    assert not (tmp_path / "c").exists()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def make_limits() -> EngineLimits:
    return EngineLimits(max_seq_len=256, max_num_seqs=16, max_num_batched_tokens=256,
                        block_size=4)


def test_dead_rank_fails_the_step_clearly(tmp_path: Path) -> None:
    from python_backends.engine.ranks import RankFailure

    model = make_tiny_llama(tmp_path / "e", seed=24, parallel=ParallelLayout(tp=2), **SHAPE)
    engine = model.engine()
    try:
        group = engine.runner.group
        assert isinstance(group, RankGroup)
        assert (engine.stats().ranks_alive, engine.stats().ranks_total) == (2, 2)
        group.procs[1].kill()
        group.procs[1].wait()
        assert (engine.stats().ranks_alive, engine.stats().ranks_total) == (1, 2)
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(RankFailure, match=r"engine rank 1 \(pid \d+\) exited with status -9"):
            engine.step()
    finally:
        engine.close()
    assert not torch.distributed.is_initialized()
