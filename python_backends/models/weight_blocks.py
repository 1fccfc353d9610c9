"""Float32 weights that are exactly GGUF blocks: found, so that few-row steps read them as such.

A checkpoint dequantized from GGUF (the default model: SmolLM2's GGUF, dequantized by
transformers at engine build) holds float32 weights that are, bit for bit, what gguf's
dequantization computed in float32 from blocks of 32 consecutive inputs of an output feature:
- 4-bit blocks: w = fl(fl(d * q) + m), q in [0, 15], one d and m per block of at most 17
  significant bits (so d q is exact). Q4_1 (the default model's projections: float16 d and m),
  Q4_0 (d (q - 8): m = -8 d) and Q4_K (d = float16 x 6-bit scale, m = -(float16 x 6-bit min)
  per 32-input sub-block) all are. `q4_1_blocks` recovers (q, d, m) from the float32 values
  alone: the quick way m is the block's minimum (q = 0) and d the float16 nearest
  (max - m) / 15 or a neighbour; else the values are fitted as a grid of at most 16 levels (d
  from their gaps and span, m from the minimum's level).
- Q8_0 (its embedding, the tied LM head): w = fl(d * q), q in [-128, 127], d float16.
  `q8_0_blocks`: d the float16 nearest max |w| / 127 or a neighbour.
Either keeps what it found only if it gives back every weight (its value: a zero's sign aside,
which no sum of products sees). The search is native (csrc/weight_blocks.cpp, block by block:
0.3 s for the default model's weights), and a weight that is not made of blocks is refused at
its first block that nothing fits. The native kernel (csrc/linear.cpp, `pack_blocks`, which
checks once more with the kernel's own arithmetic) then reads a fifth (4-bit) or under a third
(Q8_0) of the bytes per weight on steps of few rows, where a step is bound by reading the
weights, and computes on the very same float32 values: results equal the float32 panels' bit
for bit. Weights that are not such blocks (a bfloat16 or float32 checkpoint, other GGUF types)
stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # inputs per (d, m)


@dataclass(frozen=True)
class Q41Blocks:
    """w[n, k] = fl(fl(d[n, k // 32] * q[n, k]) + m[n, k // 32]) exactly (any 4-bit block: the
    kernel's Q4_1 layout)."""

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


def _find(weight: torch.Tensor, q4_1: bool) -> tuple[torch.Tensor, ...] | None:
    """The native search (csrc/weight_blocks.cpp: each block's estimate of d and its float16
    neighbours, block by block, the first block none fits ending it); None where `weight` is
    not made of such blocks."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    found = torch.ops.llm_kernels.find_blocks(weight.detach().cpu(), q4_1)
    return found if found[0].numel() else None


def q4_1_blocks(weight: torch.Tensor) -> Q41Blocks | None:
    """The 4-bit blocks (gguf's Q4_1, Q4_0 or Q4_K) that `weight` [N, K] (float32) is made of,
    or None where it is not made of them (K not a multiple of 32, or a block no (d, m)
    reproduces). Needs the native kernels loaded (models.kernels.load)."""
    found = _find(weight, True)
    return Q41Blocks(*found) if found is not None else None


def q8_0_blocks(weight: torch.Tensor) -> Q80Blocks | None:
    """The Q8_0 blocks that `weight` [N, K] (float32) is made of, or None where it is not made
    of them (K not a multiple of 32, or a block no float16 d reproduces bit for bit). Needs the
    native kernels loaded."""
    found = _find(weight, False)
    return Q80Blocks(*found[:2]) if found is not None else None
