"""Shared fixtures: small random-weight Llama engines with Hugging Face as the reference."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from python_backends.config import EngineLimits, ParallelLayout
from python_backends.engine.builder import write_engine
from python_backends.engine.llm_engine import LLMEngine


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (registered as `script_<name>`, so its dataclasses work)."""
    path = Path(__file__).parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"script_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Clock:
    """A simulated clock for policies that take `clock=`: set `t` to move time."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class TinyModel:
    engine_dir: Path
    hf: Any

    def engine(self, num_kv_blocks: int = 64, **kwargs: Any) -> LLMEngine:
        return LLMEngine.from_engine_dir(self.engine_dir, num_kv_blocks=num_kv_blocks, **kwargs)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """Hugging Face greedy continuation of exactly n tokens."""
        out = self.hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )
        return list(out[0, len(prompt):].tolist())


def make_tiny_llama(
    out_dir: Path, seed: int = 0, limits: EngineLimits | None = None,
    parallel: ParallelLayout | None = None, weights: Callable[[Any], None] | None = None,
    **config: Any
) -> TinyModel:
    """`weights`: edits the Hugging Face model's weights before the engine is written (the
    reference computes on the edited ones too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # A large init scale keeps logits peaked, so float noise cannot flip a greedy argmax.
    defaults: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, tie_word_embeddings=False,
    )
    cfg = LlamaConfig(**{**defaults, **config})
    hf = LlamaForCausalLM(cfg).eval()
    if weights is not None:
        weights(hf)
    limits = limits or EngineLimits(max_seq_len=256, max_num_seqs=16, max_num_batched_tokens=256,
                                    block_size=4)
    write_engine(hf, None, out_dir, limits, "float32", "random", log=lambda _m: None,
                 parallel=parallel)
    return TinyModel(out_dir, hf)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "engine")


def prompts(n: int, seed: int = 1, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(1, 256, (k,), generator=g).tolist() for k in lengths]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run only where CUDA is available; elsewhere they are skipped."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
