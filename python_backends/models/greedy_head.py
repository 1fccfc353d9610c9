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

from dataclasses import dataclass

import torch

from python_backends.models import kernels

GROUP = 64  # inputs per int8 scale, on x and on W (csrc/linear.cpp's kGroup)


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


@dataclass(frozen=True)
class GreedyHead:
    """The argmax of x W^T by screening (module docstring); `build` makes one for a weight."""

    weight: torch.Tensor  # [V, K] float32: the candidates' logits are computed from it
    path: str  # kernels.screen_path(): "amx" or "avx512_vnni"
    screen: torch.Tensor  # W's rounding w0, packed for the path's screen
    w_norm: torch.Tensor  # [V] |w| of each token's row
    dw_norm: torch.Tensor  # [V] |w - w0|

    @classmethod
    def build(cls, weight: torch.Tensor) -> GreedyHead | None:
        """For a float32 CPU weight [V, K] where the native kernels screen (AMX tiles or
        AVX-512 VNNI: kernels.screen_path); else None (the caller computes the logits)."""
        path = kernels.screen_path() if weight.device.type == "cpu" else ""
        if weight.dtype != torch.float32 or weight.dim() != 2 or not path:
            return None
        weight = weight.detach().contiguous()
        ops = torch.ops.llm_kernels
        if path == "amx":
            w0 = bf16_round(weight)
            screen = ops.pack_screen_weight(w0)
        else:
            q, scale, w0 = quantize_groups(weight)
            screen = ops.pack_int8_screen(q.to(torch.int8), scale)
        w_norm, dw_norm = weight.norm(dim=1), (weight - w0).norm(dim=1)
        if not bool(torch.isfinite(w_norm).all()):
            return None
        return cls(weight, path, screen, w_norm, dw_norm)

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def estimate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x0, the screen's estimate of x0 . w0 for every token [N, V]) for float32 x [N, K]."""
        ops = torch.ops.llm_kernels
        if self.path == "amx":
            x0 = bf16_round(x)
            return x0, ops.screen_linear(x0, self.screen, self.vocab_size)
        q, scales, x0 = quantize_groups(x)
        return x0, ops.int8_screen((q + 128).to(torch.uint8), scales, self.screen,
                                   self.vocab_size)

    def tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """The argmax of each row of x W^T ([N] int64) for float32 x [N, K]; None where x holds
        a value that is not finite (the caller then computes the logits, as max would see
        them)."""
        x = x.contiguous()
        nx = x.norm(dim=1)
        if not bool(torch.isfinite(nx).all()):
            return None
        x0, estimate = self.estimate(x)
        nx0, dx = x0.norm(dim=1), (x - x0).norm(dim=1)
        g = 2 * (x.shape[1] + 2) * 2.0 ** -24
        # E = a |w| + b |w - w0|, using |w0| <= |w| + |w - w0| for the estimate's sum.
        a, b = dx + g * (nx + nx0), nx0 * (1 + g)
        rows, cols = torch.ops.llm_kernels.screen_candidates(estimate, a, b, self.w_norm,
                                                             self.dw_norm)
        return torch.ops.llm_kernels.candidate_argmax(x, self.weight, rows, cols)
