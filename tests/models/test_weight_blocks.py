"""Float32 weights found to be exact GGUF Q4_1 and Q8_0 blocks (models/weight_blocks.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from python_backends.models import kernels
from python_backends.models.weight_blocks import BLOCK, q4_1_blocks, q8_0_blocks


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
