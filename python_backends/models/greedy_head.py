"""Greedy tokens from the LM head without computing every logit in float32.

A greedy row needs only the argmax of its logits x W^T (W [V, K], one row w per token). The
native kernel estimates all of them from roundings x0 of x and w0 of W, packed once at load:

- `amx`: bfloat16 roundings, one AMX tile product per output tile instead of the float32
  projection's six (`screen_linear`), from a bfloat16 copy of W (half its bytes);
- `avx512_vnni`: int8 roundings, four products of bytes where a float32 FMA does one
  (`int8_screen`), from an int8 copy of W (a quarter of its bytes): each row of x and of W
  quantized by groups of GROUP inputs with one scale each (hidden states have a few large
  channels: one scale for a whole row would blur the rest and leave hundreds of candidates a
  row instead of a few).

On AMX tiles the head also keeps the int8 copy (every CPU with tiles has VNNI) and screens steps
of at most FEW_ROWS rows on it: a step of few rows reads every weight once, and the int8 copy is
half the bfloat16 one's bytes, while the tiles' products win from a tile's rows on.

A bound on each estimate's error leaves only the few tokens whose logit could be the largest
(`screen_candidates`); their logits are then computed in float32 from the float32 weight
(`candidate_argmax`). The token is the argmax of those float32 logits, so the same token as
computing every logit in float32 (the lowest index among equal largest values, as `max`
picks), whatever the estimates' errors, because for every row x and token w

    |x . w - x0 . w0| <= |x - x0| |w| + |x0| |w - w0|       (Cauchy-Schwarz, term by term)

and summing in float32 moves the estimate by at most g |x0| |w0| <= g |x0| (|w| + |w - w0|)
and the float32 logit by at most g |x| |w| with g = (K + 2) 2^-24; we take g twice that, which
also covers the rounding of the bound, of the scales and of the comparisons themselves (the
int8 sums themselves are exact). With E(x, w) that bound, a token whose estimate plus E is below
some other token's estimate minus its E cannot have the largest logit. On SmolLM2 a row keeps
a few of its 49152 tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from python_backends.models import kernels

GROUP = 64  # inputs per int8 scale, on x and on W (csrc/linear.cpp's kGroup)
# Steps of at most this many rows screen on int8 where the head has both copies. The head's
# tokens for chat hidden states on a 2-core Emerald Rapids, AMX -> int8 (ms): 1 row 2.78 ->
# 1.69, 4 rows 2.95 -> 1.86, 8 rows 3.13 -> 2.56, 12 rows 3.60 -> 3.23, 16 rows 3.74 -> 4.12.
FEW_ROWS = 12


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 (to nearest), in float32: its own first piece, so the kernel
    multiplies exactly these values."""
    return x.to(torch.bfloat16).to(torch.float32)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of x [N, K] in groups of GROUP inputs (zero-padded to Kp) as q in [-127, 127]
    times one float32 scale a group (its largest magnitude over 127; 1 for zeros): (q [N, Kp]
    float32, scales [N, Kp / GROUP], x0 [N, K] = q x scale)."""
    n, k = x.shape
    kp = -(-k // GROUP) * GROUP
    xg = torch.nn.functional.pad(x, (0, kp - k)).view(n, kp // GROUP, GROUP)
    scale = xg.abs().amax(dim=2) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xg / scale[:, :, None]).round().clamp(-127, 127)
    x0 = (q * scale[:, :, None]).view(n, kp)[:, :k]
    return q.view(n, kp), scale, x0


class _Kernels(NamedTuple):
    """One screen path: how it rounds a matrix's rows, how it packs W's, how it multiplies."""

    # x [N, K] -> (operand, scales, x0): what the kernel reads, and x0 = the values it multiplies
    rounding: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    pack: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # W's (operand, scales)
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def _bf16_rounding(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x0 = bf16_round(x)
    return x0, x0.new_empty(0), x0


PATHS = {  # by kernels.screen_paths' names
    "amx": _Kernels(
        _bf16_rounding,
        lambda w0, _: torch.ops.llm_kernels.pack_screen_weight(w0),
        lambda x0, _, packed, vocab: torch.ops.llm_kernels.screen_linear(x0, packed, vocab)),
    "avx512_vnni": _Kernels(
        quantize_groups,
        lambda q, scales: torch.ops.llm_kernels.pack_int8_screen(q.to(torch.int8), scales),
        lambda q, scales, packed, vocab: torch.ops.llm_kernels.int8_screen(
            (q + 128).to(torch.uint8), scales, packed, vocab)),
}


def rounded(x: torch.Tensor, path: str) -> torch.Tensor:
    """x0, the rounding of x [N, K] a path's screen multiplies."""
    return PATHS[path].rounding(x)[2]


@dataclass(frozen=True)
class Screen:
    """W's rounding w0 packed for one path's kernel, and |w - w0| of each token's row."""

    path: str  # one of PATHS
    packed: torch.Tensor
    dw_norm: torch.Tensor  # [V]

    @classmethod
    def build(cls, weight: torch.Tensor, path: str) -> Screen:
        kernel = PATHS[path]
        operand, scales, w0 = kernel.rounding(weight)
        return cls(path, kernel.pack(operand, scales), (weight - w0).norm(dim=1))

    def estimate(self, x: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x0, x0 . w0 for every token [N, vocab]) for float32 x [N, K]."""
        kernel = PATHS[self.path]
        operand, scales, x0 = kernel.rounding(x)
        return x0, kernel.product(operand, scales, self.packed, vocab)


@dataclass(frozen=True)
class GreedyHead:
    """The argmax of x W^T by screening (module docstring); `build` makes one for a weight."""

    weight: torch.Tensor  # [V, K] float32: the candidates' logits are computed from it
    w_norm: torch.Tensor  # [V] |w| of each token's row
    screen: Screen  # on kernels.screen_paths()'s first
    few_rows: Screen | None = None  # int8, for steps of at most FEW_ROWS rows, beside AMX's

    @classmethod
    def build(cls, weight: torch.Tensor) -> GreedyHead | None:
        """For a float32 CPU weight [V, K] where the native kernels screen (AMX tiles or
        AVX-512 VNNI: kernels.screen_paths); else None (the caller computes the logits)."""
        paths = kernels.screen_paths() if weight.device.type == "cpu" else ()
        if weight.dtype != torch.float32 or weight.dim() != 2 or not paths:
            return None
        weight = weight.detach().contiguous()
        w_norm = weight.norm(dim=1)
        if not bool(torch.isfinite(w_norm).all()):
            return None
        few_rows = Screen.build(weight, paths[1]) if len(paths) > 1 else None
        return cls(weight, w_norm, Screen.build(weight, paths[0]), few_rows)

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def paths(self) -> tuple[str, ...]:
        """The screens' paths, many rows' first."""
        return (self.screen.path,) + ((self.few_rows.path,) if self.few_rows else ())

    def screen_for(self, rows: int) -> Screen:
        return self.few_rows if self.few_rows is not None and rows <= FEW_ROWS else self.screen

    def tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """The argmax of each row of x W^T ([N] int64) for float32 x [N, K]; None where x holds
        a value that is not finite (the caller then computes the logits, as max would see
        them)."""
        x = x.contiguous()
        nx = x.norm(dim=1)
        if not bool(torch.isfinite(nx).all()):
            return None
        screen = self.screen_for(x.shape[0])
        x0, estimate = screen.estimate(x, self.vocab_size)
        nx0, dx = x0.norm(dim=1), (x - x0).norm(dim=1)
        g = 2 * (x.shape[1] + 2) * 2.0 ** -24
        # E = a |w| + b |w - w0|, using |w0| <= |w| + |w - w0| for the estimate's sum.
        a, b = dx + g * (nx + nx0), nx0 * (1 + g)
        rows, cols = torch.ops.llm_kernels.screen_candidates(estimate, a, b, self.w_norm,
                                                             screen.dw_norm)
        return torch.ops.llm_kernels.candidate_argmax(x, self.weight, rows, cols)
