"""Greedy tokens from the LM head without computing every logit in float32.

A greedy row needs only the argmax of its logits x W^T (W [V, K], one row w per token). The
native kernel estimates all of them from bfloat16 roundings x0 of x and w0 of W
(`screen_linear`: one AMX tile product per output tile instead of the float32 projection's six,
or on AVX-512 bfloat16 dot products where there are no tiles, twice float32's multiply-adds per
instruction; from a bfloat16 copy of W packed once, half its bytes), and a bound on each
estimate's error leaves only the few tokens whose logit could be the largest
(`screen_candidates`); their logits are then computed in float32 from the float32 weight. The
token is the argmax of those float32 logits, so the same token as computing every logit in
float32 (the lowest index among equal largest values, as `max` picks), whatever the estimates'
errors, because for every row x and token w

    |x . w - x0 . w0| <= |x - x0| |w| + |x0| |w - w0|       (Cauchy-Schwarz, term by term)

and summing in float32 moves the estimate by at most g |x0| |w0| and the float32 logit by at
most g |x| |w| with g = (K + 2) 2^-24; we take g twice that, which also covers the rounding of
the bound and of the comparisons themselves. With E(x, w) that bound, a token whose estimate
plus E is below some other token's estimate minus its E cannot have the largest logit. On
SmolLM2 a row keeps a few of its 49152 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from python_backends.models import kernels


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 (to nearest), in float32: its own first piece, so the kernel
    multiplies exactly these values."""
    return x.to(torch.bfloat16).to(torch.float32)


@dataclass(frozen=True)
class GreedyHead:
    """The argmax of x W^T by screening (module docstring); `build` makes one for a weight."""

    weight: torch.Tensor  # [V, K] float32: the candidates' logits are computed from it
    screen: torch.Tensor  # W rounded to bfloat16, packed for screen_linear
    w_norm: torch.Tensor  # [V] |w| of each token's row
    dw_norm: torch.Tensor  # [V] |w - w0|

    @classmethod
    def build(cls, weight: torch.Tensor) -> GreedyHead | None:
        """For a float32 CPU weight [V, K] where the native kernels screen (AMX tiles or
        AVX-512 bf16: kernels.screen_path); else None (the caller computes the logits)."""
        if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
                or not kernels.screen_path()):
            return None
        weight = weight.detach().contiguous()
        w0 = bf16_round(weight)
        w_norm, dw_norm = weight.norm(dim=1), (weight - w0).norm(dim=1)
        if not bool(torch.isfinite(w_norm).all()):
            return None
        return cls(weight, torch.ops.llm_kernels.pack_screen_weight(w0), w_norm, dw_norm)

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """The argmax of each row of x W^T ([N] int64) for float32 x [N, K]; None where x holds
        a value that is not finite (the caller then computes the logits, as max would see
        them)."""
        x = x.contiguous()
        x0 = bf16_round(x)
        nx, nx0, dx = x.norm(dim=1), x0.norm(dim=1), (x - x0).norm(dim=1)
        if not bool(torch.isfinite(nx).all()):
            return None
        g = 2 * (x.shape[1] + 2) * 2.0 ** -24
        # E = a |w| + b |w - w0|, using |w0| <= |w| (1 + 2^-8) for the estimate's sum.
        a = dx + g * (nx + nx0 * (1 + 2.0 ** -8))
        estimate = torch.ops.llm_kernels.screen_linear(x0, self.screen, self.vocab_size)
        rows, cols = torch.ops.llm_kernels.screen_candidates(estimate, a, nx0, self.w_norm,
                                                             self.dw_norm)
        logits = (x[rows] * self.weight[cols]).sum(dim=1)
        best = torch.full((x.shape[0],), float("-inf")).scatter_reduce(
            0, rows, logits, "amax")
        top = logits == best[rows]
        return torch.full((x.shape[0],), self.vocab_size, dtype=torch.long).scatter_reduce(
            0, rows[top], cols[top], "amin")
