"""Float32 weights that are exactly GGUF blocks: found, so that few-row steps read them as such.

A checkpoint dequantized from GGUF (the default model: SmolLM2's GGUF, dequantized by
transformers at engine build) holds float32 weights that are, bit for bit, what gguf's
dequantization computed in float32 from blocks of 32 consecutive inputs of an output feature,
each with a float16 scale d:
- Q4_1 (the default model's projections): w = fl(fl(d * q) + m), a float16 minimum m per block
  and a 4-bit q in [0, 15] per weight. `q4_1_blocks` recovers (q, d, m) from the float32 values
  alone: m is the block's minimum (where q = 0), d the float16 nearest (max - m) / 15 or a
  neighbour.
- Q8_0 (its embedding, the tied LM head): w = fl(d * q), q in [-128, 127]. `q8_0_blocks`: d the
  float16 nearest max |w| / 127 or a neighbour.
Either keeps what it found only if it gives back every weight bit for bit. The native kernel
(csrc/linear.cpp, `pack_blocks`, which checks once more with the kernel's own arithmetic) then
reads a fifth (Q4_1) or under a third (Q8_0) of the bytes per weight on steps of few rows, where
a step is bound by reading the weights, and computes on the very same float32 values: results
equal the float32 panels' bit for bit. Weights that are not such blocks (a bfloat16 or float32
checkpoint, other GGUF types) stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # inputs per (d, m)
LEVELS = 15  # Q4_1: q in [0, LEVELS]
Q8_MAX = 127  # Q8_0: the largest |q| (llama.cpp's quantizer maps max |w| to it)
STEPS = (0, -1, 1, -2, 2)  # float16 neighbours of a scale's estimate, nearest first


@dataclass(frozen=True)
class Q41Blocks:
    """w[n, k] = fl(fl(d[n, k // 32] * q[n, k]) + m[n, k // 32]) exactly."""

    q: torch.Tensor  # uint8 [N, K]
    d: torch.Tensor  # float32 [N, K / 32]
    m: torch.Tensor  # float32 [N, K / 32]

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.view(n, k // BLOCK, BLOCK).float()
        return torch.add(torch.mul(q, self.d[..., None]), self.m[..., None]).view(n, k)


@dataclass(frozen=True)
class Q80Blocks:
    """w[n, k] = fl(d[n, k // 32] * q[n, k]) exactly."""

    q: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # float32 [N, K / 32]

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return torch.mul(self.q.view(n, k // BLOCK, BLOCK).float(), self.d[..., None]).view(n, k)


def _fp16_steps(d: torch.Tensor, step: int) -> torch.Tensor:
    """`d` rounded to float16 and moved `step` float16 values along (positive ones), as
    float32."""
    bits = d.half().view(torch.int16).to(torch.int32) + step
    return bits.clamp(0, 0x7BFF).to(torch.int16).view(torch.float16).float()


def _blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] as [N, K / 32, 32] blocks, or None where it cannot be GGUF blocks."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    if weight.numel() == 0:
        return None
    w = weight.detach().cpu().contiguous()
    return w.view(w.shape[0], -1, BLOCK)


def _fit(blocks: torch.Tensor, estimate: torch.Tensor, offset: torch.Tensor | None, low: int,
         high: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [N, K], d [N, K / 32]) such that fl(fl(d q) + offset) (no offset: fl(d q)) is every
    block's value bit for bit, q in [low, high] and d the first float16 of STEPS around each
    block's `estimate` that gives them back; None where a block has none."""
    if not torch.isfinite(estimate).all():
        return None
    want = blocks.view(torch.int32)
    q = torch.zeros(blocks.shape, dtype=dtype)
    d = torch.zeros_like(estimate)
    todo = torch.ones_like(estimate, dtype=torch.bool)
    for step in STEPS:
        if not todo.any():
            break
        idx = todo.nonzero(as_tuple=True)
        cand = _fp16_steps(estimate[idx], step)[:, None]
        vals = blocks[idx]
        base = offset[idx][:, None] if offset is not None else None
        scale = torch.where(cand > 0, cand, torch.ones_like(cand))
        levels = torch.round((vals if base is None else vals - base) / scale).clamp(low, high)
        levels = torch.where(cand > 0, levels, torch.zeros_like(levels))
        got = torch.mul(levels, cand)
        if base is not None:
            got = torch.add(got, base)
        ok = (got.view(torch.int32) == want[idx]).all(-1)
        if step == 0 and not ok.any():
            return None  # not one block at the nearest scale: not made of blocks (a float model)
        rows, cols = idx[0][ok], idx[1][ok]
        q[rows, cols] = levels[ok].to(dtype)
        d[rows, cols] = cand[ok, 0]
        todo[rows, cols] = False
    if todo.any():
        return None
    return q.view(blocks.shape[0], -1), d


def q4_1_blocks(weight: torch.Tensor) -> Q41Blocks | None:
    """The Q4_1 blocks that `weight` [N, K] (float32) is made of, or None where it is not made
    of them (K not a multiple of 32, or a block no (d, m) reproduces bit for bit)."""
    blocks = _blocks(weight)
    if blocks is None or (len(blocks) > 1 and q4_1_blocks(weight[:1]) is None):
        return None  # the first feature's blocks decide cheaply for a float model
    m = blocks.amin(-1)
    if not torch.equal(m.half().float(), m):
        return None  # a minimum that is no float16: not a Q4_1 block
    found = _fit(blocks, (blocks.amax(-1) - m) / LEVELS, m, 0, LEVELS, torch.uint8)
    return Q41Blocks(found[0], found[1], m) if found is not None else None


def q8_0_blocks(weight: torch.Tensor) -> Q80Blocks | None:
    """The Q8_0 blocks that `weight` [N, K] (float32) is made of, or None where it is not made
    of them (K not a multiple of 32, or a block no float16 d reproduces bit for bit)."""
    blocks = _blocks(weight)
    if blocks is None or (len(blocks) > 1 and q8_0_blocks(weight[:1]) is None):
        return None
    found = _fit(blocks, blocks.abs().amax(-1) / Q8_MAX, None, -Q8_MAX - 1, Q8_MAX, torch.int8)
    return Q80Blocks(*found) if found is not None else None
