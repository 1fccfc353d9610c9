"""kernels.DecoderStack (csrc/decoder_stack.cpp): every layer of a step in one native call
gives the layers' own forward's results bit for bit, on every kind of step the engine makes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from python_backends.config import EngineLimits
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.speculative import SpeculationConfig
from python_backends.models import kernels
from python_backends.models.attention import AttentionMetadata
from python_backends.params import SamplingParams
from tests.conftest import TinyModel, make_tiny_llama, prompts
from tests.models.test_families import make_family

pytestmark = pytest.mark.skipif(not kernels.load(), reason="native kernels unavailable")


def native_engine(engine_dir: Path, **kwargs: Any) -> LLMEngine:
    threads = torch.get_num_threads()
    try:  # one torch thread: the native kernels' engine
        return LLMEngine.from_engine_dir(engine_dir, num_kv_blocks=128, cpu_threads=1,
                                         enable_prefix_caching=True, **kwargs)
    finally:
        torch.set_num_threads(threads)


def step_kind(meta: AttentionMetadata) -> str:
    if not meta.prefills:
        return "decodes"
    cached = any(s.mask is not None for s in meta.prefills)
    return ("mixed " if meta.decode is not None else "") + ("cached prompt" if cached else "prompt")


def tiny_model(name: str, out_dir: Path) -> TinyModel:
    """Llama with 64-float heads (decode attention's register path) and a step budget that cuts
    the long prompt into chunks; the other families at test_families' shapes: Qwen2's q/k/v
    bias, Qwen3's q/k norms, Mistral's window over every layer."""
    if name == "llama":
        limits = EngineLimits(max_seq_len=256, max_num_seqs=16, max_num_batched_tokens=64,
                              block_size=4)
        return make_tiny_llama(out_dir, limits=limits, hidden_size=256, intermediate_size=512,
                               num_attention_heads=4, num_key_value_heads=2)
    return make_family(name, out_dir)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_stack_computes_what_the_layers_do_bit_for_bit(tmp_path: Path, name: str) -> None:
    """Each step of an engine serving prompts with shared prefixes (prompts over a cached
    context), chunked, beside decoding sequences and their drafts, through the stack and through
    the layers one by one: the same hidden states exactly; and greedy output is Hugging Face's."""
    tiny = tiny_model(name, tmp_path / "engine")
    engine = native_engine(tiny.engine_dir)
    engine.scheduler.speculation = SpeculationConfig(3, ngram_min=1, adaptive=False)
    model = engine.runner.model.model
    stack = model.native_stack
    assert stack is not None
    kinds: Counter[str] = Counter()
    layers_forward = model.forward

    def both(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        model.native_stack = None
        want = layers_forward(x, meta)
        model.native_stack = stack
        got = layers_forward(x, meta)
        assert torch.equal(got, want), step_kind(meta)
        kinds[step_kind(meta)] += 1
        return got

    model.forward = both  # type: ignore[method-assign]
    shared = prompts(1, seed=5, lo=30, hi=31)[0]
    batch = [shared + p for p in prompts(6, seed=3, lo=3, hi=20)]
    batch += [(p * 6)[:60] for p in prompts(2, seed=4, lo=4, hi=6)]  # repeats: drafts kept
    batch.append(prompts(1, seed=6, lo=100, hi=101)[0])  # over a step's budget: in chunks
    batch = [[t % tiny.hf.config.vocab_size for t in p] for p in batch]
    seqs = [engine.add_request(f"s{i}", p, SamplingParams(max_tokens=10))
            for i, p in enumerate(batch)]
    try:
        for _ in range(400):
            if not engine.has_unfinished:
                break
            engine.step()
    finally:
        engine.close()
    assert not engine.has_unfinished
    assert "decodes" in kinds and any(k.startswith("mixed") for k in kinds), kinds
    assert any("cached" in k for k in kinds), kinds
    assert engine.stats().draft_tokens > 0
    for p, seq in zip(batch, seqs, strict=True):
        assert seq.output_ids == hf_greedy(tiny.hf, p, 10)


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Hugging Face's argmax continuation of n tokens, the end token a token like any other
    (as the engine, which has no tokenizer here, treats it; generate would refuse it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_layers_it_does_not_compute_run_one_by_one(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2's softcap and sandwich norms and Mixtral's experts are not the stack's kind, and
    LLM_NATIVE_STACK=0 switches it off: each way the layers run from Python."""
    def stacked(engine_dir: Path) -> bool:
        engine = native_engine(engine_dir)
        engine.close()
        return engine.runner.model.model.native_stack is not None

    for name in ("gemma2", "mixtral"):
        assert not stacked(make_family(name, tmp_path / name).engine_dir), name
    plain = make_tiny_llama(tmp_path / "plain").engine_dir
    assert stacked(plain)
    monkeypatch.setenv(kernels.STACK_ENV, "0")
    assert not stacked(plain)
