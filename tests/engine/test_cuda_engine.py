"""The engine on GPUs: weights, KV pools and steps on CUDA devices, multi-rank layouts over
NCCL (one rank per GPU), KV handed between GPU engines. Greedy output equals Hugging Face's
float32 output (computed on the CPU) token for token.

Needs CUDA: the `gpu` marker skips this module elsewhere, and layouts needing more GPUs than
visible skip with the count they need. `scripts/gpu_check.sh` runs it on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from python_backends.config import EngineLimits, ParallelLayout
from python_backends.engine.speculative import SpeculationConfig
from python_backends.parallel.placement import Placement
from python_backends.params import SamplingParams
from tests.conftest import TinyModel, make_tiny_llama, prompts
from tests.engine.test_llm_engine import run_all
from tests.parallel.test_heterogeneous_handoff import N, hand_over
from tests.parallel.test_moe import make_tiny_mixtral
from tests.parallel.test_parallel_engine import SHAPE, check_layout

pytestmark = pytest.mark.gpu
GPU = Placement("GPU", 0)


def gpus(n: int) -> pytest.MarkDecorator:
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(visible < n, reason=f"needs {n} GPUs (NCCL: one rank per GPU); "
                                                  f"{visible} visible")


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_one_gpu_matches_hf(tiny_llama: TinyModel, graphs: bool) -> None:
    """Decode steps replayed from CUDA graphs (8 rows: rung 8), or launched eagerly; the cache
    read in place by the Triton kernel either way."""
    engine = tiny_llama.engine(placement=GPU, cuda_graphs=graphs)
    assert engine.runner.kv_pool.is_cuda and engine.handoff.pool.is_cuda
    assert all(p.is_cuda for p in engine.runner.model.parameters() if p.numel())
    assert engine.runner.block_tables
    assert (engine.runner.graphs is not None) == graphs
    batch = prompts(8, seed=2)
    assert run_all(engine, batch, 16) == [tiny_llama.greedy(p, 16) for p in batch]
    if engine.runner.graphs is not None:  # at least the 15 steps after the last prompt's
        assert engine.runner.graphs.replays >= 15


def test_graphs_with_drafts_and_odd_batches_match_hf(tiny_llama: TinyModel) -> None:
    """Drafted rows (up to 5 per sequence) and batches between rungs (3, 5, 7 rows: padding
    rows that must neither write nor read the cache)."""
    engine = tiny_llama.engine(placement=GPU, speculation=SpeculationConfig(num_tokens=4))
    graphs = engine.runner.graphs
    assert graphs is not None
    for n in (3, 5, 7):
        batch = [p * 3 for p in prompts(n, seed=40 + n, lo=4, hi=12)]  # repeats: drafts
        assert run_all(engine, batch, 20) == [tiny_llama.greedy(p, 20) for p in batch]
    assert graphs.replays > 0 and engine.scheduler.num_accepted_tokens > 0
    assert engine.blocks.num_used == 0


def test_one_gpu_chunked_prefill_matches_hf(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine(placement=GPU)
    engine.scheduler.limits = EngineLimits(max_seq_len=256, max_num_seqs=16,
                                           max_num_batched_tokens=7, block_size=4)
    batch = prompts(4, seed=3, lo=30, hi=60)
    assert run_all(engine, batch, 12) == [tiny_llama.greedy(p, 12) for p in batch]


def test_sampling_on_gpu_logits_is_seeded(tiny_llama: TinyModel) -> None:
    """Non-greedy rows go through the CPU sampler with each sequence's seeded generator."""
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=7,
                            repetition_penalty=1.2, return_log_probs=True)

    def sample_once() -> list[int]:
        engine = tiny_llama.engine(placement=GPU)
        engine.add_request("s", prompts(1, seed=4)[0], params)
        out: list[int] = []
        while engine.has_unfinished:
            out.extend(ev.token_id for ev in engine.step())
        return out

    first = sample_once()
    assert len(first) == 12 and first == sample_once()


@pytest.mark.parametrize("tp,pp", [
    pytest.param(2, 1, marks=gpus(2)), pytest.param(1, 2, marks=gpus(2)),
    pytest.param(4, 1, marks=gpus(4)), pytest.param(2, 2, marks=gpus(4)),
], ids=["tp2", "pp2", "tp4", "tp2-pp2"])
def test_nccl_layouts_match_hf(tmp_path: Path, tp: int, pp: int) -> None:
    model = make_tiny_llama(tmp_path / "e", seed=21, parallel=ParallelLayout(tp=tp, pp=pp),
                            **SHAPE)
    check_layout(model, placement=GPU)


@pytest.mark.parametrize("layout", [
    pytest.param(ParallelLayout(ep=2), marks=gpus(2)),
    pytest.param(ParallelLayout(tp=2, ep=2), marks=gpus(2)),
], ids=["ep2", "tp2-ep2"])
def test_nccl_experts_match_hf(tmp_path: Path, layout: ParallelLayout) -> None:
    check_layout(make_tiny_mixtral(tmp_path / "e", layout), placement=GPU)


@pytest.mark.parametrize("prefill_layout,decode_layout", [
    (ParallelLayout(), ParallelLayout()),
    pytest.param(ParallelLayout(tp=2), ParallelLayout(), marks=gpus(2)),
    pytest.param(ParallelLayout(), ParallelLayout(tp=2), marks=gpus(2)),
], ids=["tp1-to-tp1", "tp2-to-tp1", "tp1-to-tp2"])
def test_gpu_handoff_matches_hf(tmp_path: Path, prefill_layout: ParallelLayout,
                                decode_layout: ParallelLayout) -> None:
    """Prefill on GPU 0 (and 1), decode on GPU 0 (and 1): the whole-model pools are on GPU 0
    and the KV is re-sliced between layouts on the way."""
    a = make_tiny_llama(tmp_path / "a", seed=51, parallel=prefill_layout, **SHAPE)
    b = make_tiny_llama(tmp_path / "b", seed=51, parallel=decode_layout, **SHAPE)
    batch = [[t % 250 for t in p] for p in prompts(4, seed=52, lo=5, hi=40)]
    prefill, decode = a.engine(placement=GPU), b.engine(placement=GPU)
    try:
        assert prefill.handoff.pool.is_cuda and decode.handoff.pool.is_cuda
        assert hand_over(prefill, decode, batch) == [a.greedy(p, N) for p in batch]
        assert prefill.blocks.num_used == 0 and decode.blocks.num_used == 0
    finally:
        prefill.close()
        decode.close()
