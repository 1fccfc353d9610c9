"""scripts/build_engine.py's dtype default follows where the engine will compute: bfloat16
weights and KV for a GPU, float32 for the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import load_script


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)).save_pretrained(out)
    return out


@pytest.mark.parametrize("target,dtype", [("gpu", "bfloat16"), ("cpu", "float32")])
def test_the_default_dtype_follows_the_target(checkpoint: Path, tmp_path: Path, target: str,
                                              dtype: str) -> None:
    out = tmp_path / target
    assert load_script("build_engine").main(["--source", str(checkpoint), "--output", str(out),
                                             "--target", target]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
