"""Decode steps replayed from captured graphs (engine.cuda_graphs), without a GPU: the ladder,
and the replay's inputs (a step copied into the rung's static buffers, padding rows that
neither write nor read the cache, the sampled rows picked out) with an eager stand-in for the
captured graph, whose output must equal Hugging Face's. tests/engine/test_cuda_engine.py runs
real graphs on a GPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from python_backends.engine.cuda_graphs import DecodeGraphs, ladder
from python_backends.models import gpu_layer_ops, kernels
from python_backends.models.attention import AttentionMetadata
from tests.conftest import TinyModel, prompts
from tests.engine.test_llm_engine import run_all
from tests.models.test_gpu_attention import interpreted

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_the_ladder_covers_every_row_count_with_little_padding() -> None:
    assert ladder(1) == [1]
    assert ladder(64) == [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert ladder(320)[-3:] == [192, 256, 320]
    for top in (5, 64, 320, 512):
        rungs = ladder(top)
        assert rungs == sorted(set(rungs)) and rungs[-1] == top
        for n in range(1, top + 1):  # the rung a step of n rows takes pads at most a third
            rung = next(r for r in rungs if r >= n)
            assert rung <= max(n * 3 // 2, n + 1), (n, rung)


class Replay:
    def __init__(self, run: Callable[[], None]) -> None:
        self.replay = run


class EagerGraphs(DecodeGraphs):
    """The model run on the static buffers at each replay, into the same output tensor, as a
    captured graph would."""

    def _capture(self) -> None:
        for rows in self.rungs:
            ids, meta = self.inputs.ids[:rows], self._meta(rows)
            out = self.model(ids, meta)
            self.graphs[rows] = (Replay(self._replayer(ids, meta, out)), out)

    def _replayer(self, ids: torch.Tensor, meta: AttentionMetadata,
                  out: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                out.copy_(self.model(ids, meta))
        return run


@interpreted
def test_replayed_steps_match_hf_and_leave_the_cache_to_real_rows(
        tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # The layers as on a GPU: the Triton kernels between the projections (models.gpu_layer_ops:
    # norms, rotation with the cache write, SiLU x up) and reading the cache.
    monkeypatch.setattr(kernels, "layer_ops", lambda x: gpu_layer_ops.OPS)
    engine = tiny_llama.engine(num_kv_blocks=48)
    runner = engine.runner
    graphs = runner.graphs = EagerGraphs(runner.model, 4, 32, runner.block_size)
    assert graphs.rungs == [1, 2, 4] and graphs.rung(3) == 4 and graphs.rung(5) is None
    # 3 sequences: every decode step replays rung 4 with a padding row; 6: no rung is that
    # large, so every step runs eagerly. Prompt steps are eager in both.
    for batch, replays in ((prompts(3, seed=11, lo=3, hi=30), 5),
                           (prompts(6, seed=12, lo=3, hi=30), 0)):
        before = graphs.replays
        assert run_all(engine, batch, 6) == [tiny_llama.greedy(p, 6) for p in batch]
        assert graphs.replays - before == replays
    assert engine.blocks.num_used == 0
