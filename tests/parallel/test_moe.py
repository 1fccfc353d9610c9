"""Mixture-of-experts (Mixtral) engines: experts placed across expert-parallel ranks with
all-to-all dispatch and combine, alone and with tensor-parallel attention, equal Hugging Face's
greedy output token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from python_backends.config import EngineConfigError, EngineLimits, ParallelLayout
from python_backends.engine.builder import write_engine
from python_backends.parallel.context import COMM
from python_backends.params import SamplingParams
from tests.conftest import TinyModel
from tests.parallel.test_parallel_engine import check_layout

LIMITS = EngineLimits(max_seq_len=256, max_num_seqs=16, max_num_batched_tokens=256, block_size=4)


def make_tiny_mixtral(out_dir: Path, parallel: ParallelLayout, seed: int = 41) -> TinyModel:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    hf = MixtralForCausalLM(MixtralConfig(
        vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.3,
        tie_word_embeddings=False, sliding_window=None)).eval()
    write_engine(hf, None, out_dir, LIMITS, "float32", "random", log=lambda _m: None,
                 parallel=parallel)
    return TinyModel(out_dir, hf)


@pytest.mark.parametrize("layout", [
    ParallelLayout(), ParallelLayout(ep=2), ParallelLayout(ep=4), ParallelLayout(tp=2, ep=2),
    ParallelLayout(ep=2, pp=2),
], ids=["ep1", "ep2", "ep4", "tp2-ep2", "ep2-pp2"])
def test_moe_layout_matches_hf(tmp_path: Path, layout: ParallelLayout) -> None:
    check_layout(make_tiny_mixtral(tmp_path / "e", layout))


def test_experts_are_split_and_tokens_cross_ranks(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = make_tiny_mixtral(tmp_path / "e", ParallelLayout(ep=2))
    r1 = load_file(str(tmp_path / "e" / "rank1.safetensors"))
    assert r1["model.layers.0.mlp.experts.gate_up_proj"].shape == (2, 192, 64)  # 2 of 4 experts
    assert r1["model.layers.0.mlp.gate.weight"].shape == (4, 64)  # the router sees all
    engine = model.engine()
    try:
        COMM.take()
        COMM.enabled = True
        engine.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=2))
        while engine.has_unfinished:
            engine.step()
        assert COMM.take().get("all_to_all", 0) > 0  # dispatch and combine happened
    finally:
        COMM.enabled = False
        engine.close()


def test_expert_layouts_the_model_cannot_take_are_refused() -> None:
    with pytest.raises(EngineConfigError, match=r"tp must be 1 .* or equal ep"):
        ParallelLayout(tp=2, ep=4)
    from transformers import MixtralConfig

    from python_backends.engine.builder import model_config_from_hf

    cfg = model_config_from_hf(MixtralConfig(num_local_experts=6, num_experts_per_tok=2,
                                             sliding_window=None))
    with pytest.raises(EngineConfigError, match="ep=4 does not divide the model's 6 experts"):
        ParallelLayout(ep=4).check(cfg)
