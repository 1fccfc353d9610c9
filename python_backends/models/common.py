"""What the decoder's attention layers share: RMSNorm and the rotary position embedding (the
checkpoint's scaling: linear, llama3, LongRoPE, YaRN; rotate-half or DeepSeek's interleaved
pairs; partial rotation).

Shapes: T tokens, R rotated dimensions of a head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from python_backends.config import RopeScaling
from python_backends.models import kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (ops := kernels.layer_ops(x)) is not None:
            return ops.rms_norm(x.contiguous(), self.weight, self.eps)
        # In float32 this rounds exactly like Hugging Face's four-op version.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual stream with a layer's output added, and the
        next layer's input; `delta` None adds nothing."""
        if delta is None:
            return x, self(x)
        if (ops := kernels.layer_ops(x)) is not None:
            return ops.add_rms_norm(x.contiguous(), delta.contiguous(), self.weight, self.eps)
        x = x + delta
        return x, self(x)


def rope_inv_freq(dims: int, theta: float, scaling: RopeScaling,
                  factors: tuple[float, ...] = ()) -> torch.Tensor:
    """Inverse frequencies [R/2] of `dims` rotated dimensions, with the checkpoint's scaling
    (`factors`: LongRoPE's per-frequency divisors, its short or its long ones)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return yarn_inv_freq(dims, theta, scaling)
    if scaling.rope_type == "longrope":
        return 1.0 / (torch.tensor(factors, dtype=torch.float32)
                      * theta ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def yarn_inv_freq(dims: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: each frequency blends from its own (extrapolated) to itself / factor (interpolated)
    by how many turns it makes over the pretraining length, as transformers computes it."""
    powers = theta ** (torch.arange(0, dims, 2).float() / dims)
    original = scaling.original_max_position_embeddings

    def dim_of(turns: float) -> float:
        return dims * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the extrapolated frequency
    return (1.0 / (scaling.factor * powers)) * (1 - keep) + (1.0 / powers) * keep


def rope_angles(dims: int, max_positions: int, theta: float,
                scaling: RopeScaling) -> torch.Tensor:
    """[P, R/2]: the angle of each position and frequency. LongRoPE rotates positions below the
    pretraining length with its short factors and later ones with its long factors (as vLLM
    does; Hugging Face switches every position of a sequence to the long factors once it grows
    past that length, so the two agree on sequences within it)."""
    positions = torch.arange(max_positions).float()[:, None]
    if scaling.rope_type != "longrope":
        return positions * rope_inv_freq(dims, theta, scaling)[None, :]
    short = positions * rope_inv_freq(dims, theta, scaling, scaling.short_factor)[None, :]
    long = positions * rope_inv_freq(dims, theta, scaling, scaling.long_factor)[None, :]
    return torch.where(positions < scaling.original_max_position_embeddings, short, long)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by position (rotate-half convention), LongRoPE's
    attention factor folded in."""

    def __init__(self, dims: int, max_positions: int, theta: float, scaling: RopeScaling):
        super().__init__()
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        if torch.empty(()).is_meta:  # a model built on the meta device: tables come later
            # (the loader's reset_rotary); computing them here went through torch's Python
            # meta kernels, whose first use imports for 1.4 s.
            for name in ("cos", "sin"):
                self.register_buffer(name, torch.empty(max_positions, dims), persistent=False)
            return
        freqs = rope_angles(dims, max_positions, theta, scaling)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
        self.register_buffer("cos", emb.cos() * scaling.attention_scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling.attention_scale, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """The step's tables, looked up once and shared by every layer."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)  # [T, 1, R]
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, R]


def apply_rotary(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """x: [T, heads, D]; a partial rotation (R < D) turns the first R dimensions only."""
    cos, sin = rotary
    dims = cos.shape[-1]
    if dims < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dims], rotary), x[..., dims:]), dim=-1)
    half = dims // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_interleaved(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """x: [T, heads, R] whose rotated pairs are (0, 1), (2, 3)...; returns them rotated and laid
    out as rotate-half lays them (evens, then odds), as transformers' DeepSeek computes it."""
    cos, sin = rotary
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
