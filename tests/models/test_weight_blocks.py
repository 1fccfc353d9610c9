"""Float32 weights found to be exact GGUF blocks, 4-bit (Q4_1, Q4_0, Q4_K) and Q8_0
(models/weight_blocks.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from python_backends.engine.llm_engine import LLMEngine
from python_backends.models import kernels
from python_backends.models.decoder import NarrowerBudget
from python_backends.models.weight_blocks import BLOCK, q4_1_blocks, q8_0_blocks
from python_backends.parallel.layers import Linear
from python_backends.params import SamplingParams
from tests.conftest import make_tiny_llama, prompts


@pytest.fixture(autouse=True, scope="module")
def native_search() -> None:
    assert kernels.load(), "the native kernels did not build here (see the warning logged)"


def gguf_weight(rows: int, cols: int, kind: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """A float32 weight as transformers gets it from a GGUF of `kind`: quantized and dequantized
    by the gguf package (llama.cpp's reference quantizers and dequantization)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) / 10
    w[0, :BLOCK] = 0.25  # a constant block (Q4_1: d = 0)
    return torch.from_numpy(quants.dequantize(quants.quantize(w, kind), kind).copy())


def gguf_q4_1(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return gguf_weight(rows, cols, GGMLQuantizationType.Q4_1, seed)


def gguf_q8_0(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return gguf_weight(rows, cols, GGMLQuantizationType.Q8_0, seed)


def gguf_q4_0(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return gguf_weight(rows, cols, GGMLQuantizationType.Q4_0, seed)


def gguf_q4_k(rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> torch.Tensor:
    """A float32 weight dequantized by the gguf package from Q4_K super-blocks of random bytes
    (the gguf package has no Q4_K quantizer): float16 d and dmin below `scale`, random 6-bit
    scales and mins (0 among them: a sub-block of one value), random 4-bit q. Every such byte
    string is a valid Q4_K tensor, far-from-zero offsets included."""
    assert cols % 256 == 0, "Q4_K super-blocks are 256 inputs"
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    raw = rng.integers(0, 256, (n, 144), dtype=np.uint8)  # d, dmin, 12 bytes of scales, q
    for at in (0, 2):
        raw[:, at:at + 2] = (rng.random(n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)
    w = quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType.Q4_K)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("shape", [(1, 32), (96, 576), (7, 1536)])
def test_blocks_give_back_every_weight_bit_for_bit(shape: tuple[int, int]) -> None:
    w = gguf_q4_1(*shape)
    found = q4_1_blocks(w)
    assert found is not None
    assert found.q.dtype == torch.uint8 and int(found.q.max()) <= 15
    assert found.d.shape == found.m.shape == (shape[0], shape[1] // BLOCK)
    assert torch.equal(bits(found.dequantize()), bits(w))
    assert torch.equal(found.d.half().float(), found.d)  # float16 scales: d q exact


@pytest.mark.parametrize("scale", [0.01, 1.0, 1e-4])
def test_q4_k_and_q4_0_weights_are_found_as_4_bit_blocks(scale: float) -> None:
    """Q4_K's sub-blocks (d = float16 d' x a 6-bit scale, m = -(float16 dmin x a 6-bit min):
    no float16 scales, and not always a weight on level 0) and Q4_0's (w = d (q - 8), d of
    either sign: zeros of either sign) are 4-bit blocks too."""
    for w in (gguf_q4_k(64, 512, scale=scale), gguf_q4_0(64, 512, seed=int(1 / scale))):
        found = q4_1_blocks(w)
        assert found is not None
        assert int(found.q.max()) <= 15
        assert torch.equal(found.dequantize(), w)  # the values; a zero's sign aside


def test_weights_that_are_not_blocks_are_refused() -> None:
    assert q4_1_blocks(torch.randn(8, 64)) is None  # a float32 checkpoint
    assert q4_1_blocks(torch.randn(8, 64).bfloat16().float()) is None  # a bfloat16 one
    w = gguf_q4_1(8, 64)
    assert q4_1_blocks(w[:, :48].contiguous()) is None  # inputs not in whole blocks
    assert q4_1_blocks(w.double()) is None
    assert q4_1_blocks(torch.empty(0, 64)) is None
    one_off = w.clone()
    one_off[3, 40] = torch.nextafter(one_off[3, 40], torch.tensor(1.0))  # one ulp
    assert q4_1_blocks(one_off) is None


@pytest.mark.parametrize("shape", [(1, 32), (96, 576), (7, 1536)])
def test_q8_0_blocks_give_back_every_weight_bit_for_bit(shape: tuple[int, int]) -> None:
    w = gguf_q8_0(*shape)
    found = q8_0_blocks(w)
    assert found is not None and found.q.dtype == torch.int8
    assert torch.equal(bits(found.dequantize()), bits(w))
    assert torch.equal(found.d.half().float(), found.d)


def test_weights_that_are_not_q8_0_blocks_are_refused() -> None:
    assert q8_0_blocks(torch.randn(8, 64)) is None
    assert q8_0_blocks(gguf_q8_0(8, 64)[:, :40].contiguous()) is None
    assert q8_0_blocks(torch.empty(0, 64)) is None
    one_off = gguf_q8_0(8, 64)
    one_off[2, 7] = torch.nextafter(one_off[2, 7], torch.tensor(1.0))
    assert q8_0_blocks(one_off) is None


def q4_k_weight(w: torch.Tensor, seed: int) -> torch.Tensor:
    return gguf_q4_k(w.shape[0], w.shape[1], seed=seed, scale=0.0005)


NARROWER = {  # a checkpoint's weights as the engine build gets them, by what they are stored as
    "q4_k": q4_k_weight,  # a Q4_K GGUF, dequantized by transformers
    "bfloat16": lambda w, _seed: w.bfloat16().float(),  # most Hugging Face checkpoints
    "float16": lambda w, _seed: w.half().float(),
}


@pytest.mark.parametrize("stored", list(NARROWER))
def test_an_engine_reads_weights_in_their_narrower_form_and_matches_hf(
        tmp_path: Path, stored: str) -> None:
    """A float32 engine of a checkpoint whose projections are Q4_K blocks, bfloat16 or float16
    values: it finds every projection's narrower form (the LM head's too), and greedy output
    equals Hugging Face's on those weights, one sequence (steps that read the narrower form)
    and several (those and the float32 panels by turns)."""
    def narrower(hf: torch.nn.Module) -> None:
        with torch.no_grad():
            for i, m in enumerate(hf.modules()):
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(NARROWER[stored](m.weight, i))

    tiny = make_tiny_llama(tmp_path / "engine", hidden_size=256, intermediate_size=512,
                           weights=narrower)
    threads = torch.get_num_threads()
    try:
        engine = LLMEngine.from_engine_dir(tiny.engine_dir, num_kv_blocks=128, cpu_threads=1)
    finally:
        torch.set_num_threads(threads)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.native_blocks is not None for m in linears)
    for batch in (prompts(1), prompts(4, seed=2)):
        seqs = [engine.add_request(f"s{i}-{len(batch)}", p, SamplingParams(max_tokens=6))
                for i, p in enumerate(batch)]
        while engine.has_unfinished:
            engine.step()
        assert [s.output_ids for s in seqs] == [tiny.greedy(p, 6) for p in batch]


def test_narrower_forms_stop_at_a_quarter_of_the_memory_available() -> None:
    found: list[int] = []

    def find(w: torch.Tensor) -> torch.Tensor:
        found.append(w.numel())
        return torch.empty(w.numel(), dtype=torch.bfloat16)  # 2 bytes a weight

    budget = NarrowerBudget(4 * 2000)  # 2000 bytes for narrower forms
    weights = [torch.zeros(300) for _ in range(5)]  # 600 bytes each
    kept = [budget.blocks(find, w) for w in weights]
    assert [k is not None for k in kept] == [True, True, True, True, False]  # 2400 > 2000
    assert found == [300] * 4 and budget.refused == 1  # past it, none is even searched
    unknown = NarrowerBudget(None)  # no /proc/meminfo: no limit
    assert all(unknown.blocks(find, w) is not None for w in weights) and not unknown.refused
