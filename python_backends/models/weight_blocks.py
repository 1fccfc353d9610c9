"""Float32 weights that are exactly GGUF blocks: found, so that few-row steps read them as such.

A checkpoint dequantized from GGUF (the default model: SmolLM2's GGUF, dequantized by
transformers at engine build) holds float32 weights that are, bit for bit, what gguf's
dequantization computed in float32 from groups of consecutive inputs of an output feature, each
with a scale d (and an offset m) and a small integer level q per weight. Four kinds, each a
layout of the native kernel (csrc/linear.cpp), w = fl(fl(d q) + m):
- "q4" (groups of 32, q in [0, 15]): Q4_1 (the default model's projections: float16 d and m),
  Q4_0 (d (q - 8): m = -8 d) and Q4_K (d = float16 x 6-bit scale, m = -(float16 x 6-bit min)
  per 32-input sub-block of a 256-input super-block: the bulk of the common Q4_K_M files);
- "u8g32" (groups of 32, q in [0, 31]): the 5-bit types Q5_0, Q5_1 and Q5_K, alike;
- "u8g16" (groups of 16): Q6_K, w = fl(d q) for q in [-32, 31] and d = float16 x int8 scale,
  held as q + 32 in [0, 63] with m = -32 d (one rounding, that of d q);
- "q8" (groups of 32, m = 0, q in [-128, 127]): Q8_0 (the default model's embedding, its tied
  LM head).
`find` recovers (q, d, m) from the float32 values alone (natively, csrc/weight_blocks.cpp:
0.3 s for the default model's weights): the quick way (Q4_1, Q8_0) d is the float16 nearest
(max - min) / 15 (Q8_0: max |w| / 127) or a neighbour; else the values of each group are fitted
as a grid (d from their gaps and span, m from the minimum's level). It keeps what it found only
if it gives back every weight (its value: a zero's sign aside, which no sum of products sees),
and refuses a weight at its first group that nothing fits (a float checkpoint: at once). The
native kernel (`pack_blocks`, which checks once more with the kernel's own arithmetic) then
reads 0.75 (q4), 1.25 (u8g32, q8: 1.125) or 1.5 (u8g16) bytes a weight instead of 4 on steps
of few rows, where a step is bound by reading the weights, and computes on the very same float32
values: results equal the float32 panels' bit for bit. Weights that are not such blocks (a
float32 checkpoint, Q2_K and Q3_K, the I-quants) stay float32; a bfloat16 or float16
checkpoint's are read as such instead (kernels.NativeLinear.blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("q4", "u8g32", "u8g16", "q8")  # in the order tried: fewest bytes a weight first
GROUP = {"q4": 32, "u8g32": 32, "u8g16": 16, "q8": 32}  # inputs per d (and m)


@dataclass(frozen=True)
class Blocks:
    """w[n, k] = fl(fl(d[n, k // g] * q[n, k]) + m[n, k // g]) for groups of g inputs (no m: 0;
    the one rounding of an FMA where d q is not exact, as in Q6_K)."""

    kind: str  # KINDS
    q: torch.Tensor  # [N, K] uint8 (q8: int8)
    d: torch.Tensor  # float32 [N, K / g]
    m: torch.Tensor | None  # float32 [N, K / g]; None for q8

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        g = GROUP[self.kind]
        q = self.q.view(n, k // g, g).double()
        w = q * self.d.double()[..., None]  # exact: d q has at most 32 significant bits
        if self.m is not None:  # exact in a double for a GGUF group's d q and m
            w = w + self.m.double()[..., None]
        # then one rounding, as the kernel's FMA
        return w.float().view(n, k)


def find(weight: torch.Tensor, kind: str) -> Blocks | None:
    """The blocks of `kind` that `weight` [N, K] (float32) is made of, or None where it is not
    made of them (K not a multiple of the group, or a group nothing reproduces). Needs the
    native kernels loaded (models.kernels.load)."""
    if kind not in GROUP:
        raise ValueError(f"unknown kind {kind!r}: expected one of {', '.join(KINDS)}")
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    q, d, m = torch.ops.llm_kernels.find_blocks(weight.detach().cpu(), kind)
    if not q.numel():
        return None
    return Blocks(kind, q, d, m if kind != "q8" else None)
