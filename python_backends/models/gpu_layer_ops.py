"""The work between a layer's projections on GPUs, fused in the Triton language: RMSNorm (with
the residual add before it), the rotary embedding of q and k with the KV cache write, and
SiLU x up. The same four operations as the CPU's native kernels (csrc/layer_ops.cpp), by the
same names, so the decoder calls either through `kernels.layer_ops`.

In torch's own ops a layer of a SmolLM2-sized model ran about 36 kernels in bfloat16 (the norm
alone nine: casts, square, mean, rsqrt, products); a captured decode step of 30 layers still
took 2.4-2.6 ms on an H200 at batch 1-8, each kernel a few microseconds however little it does.
These make it about nine a layer: four projections, two norms, the rotation with the cache
write, SiLU x up and the attention (models.gpu_attention).

Numerics follow Hugging Face's: the norm in float32, its result rounded to the input's dtype
before the weight multiplies it (one rounding each, as HF's two ops do); the residual sum is
rounded to the input's dtype before it is normalized. The rotation computes in float32 and
rounds once (HF's 16-bit path rounds after each op; float32 is the same either way).

Shapes: T tokens, E hidden size, H/K query/KV heads, D head size, I intermediate size.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from python_backends.models import gpu_attention
from python_backends.models.gpu_attention import pow2


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, y_ptr, width, eps,
                    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        ok = i < width
        x = tl.load(x_ptr + row * width + i, mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * width + i, mask=ok, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # rounded as HF's add
            tl.store(sum_ptr + row * width + i, x, mask=ok)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / width + eps)
        normed = (xf * inv).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * width + i, (normed * w).to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, cache_ptr, slots_ptr, q_ptr, k_ptr,
                          stride_qkv, stride_cos, stride_plane, stride_slot,
                          HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr,
                          ROWS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, ROWS_PAD)  # q heads, then k heads
        d = tl.arange(0, DIM_PAD)
        half: tl.constexpr = DIM // 2
        h_ok = h < HEADS + KV_HEADS
        d_ok = d < DIM
        ok = h_ok[:, None] & d_ok[None, :]
        row = qkv_ptr + tok * stride_qkv
        x = tl.load(row + h[:, None] * DIM + d[None, :], mask=ok, other=0.0)
        partner = tl.where(d < half, d + half, d - half)
        y = tl.load(row + h[:, None] * DIM + partner[None, :], mask=ok, other=0.0)
        cos = tl.load(cos_ptr + tok * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + tok * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        out = (x.to(tl.float32) * cos[None, :]
               + sign[None, :] * y.to(tl.float32) * sin[None, :]).to(x.dtype)
        is_q = h < HEADS
        tl.store(q_ptr + (tok * HEADS + h[:, None]) * DIM + d[None, :], out,
                 mask=ok & is_q[:, None])
        is_k = (h >= HEADS) & h_ok
        k_head = tl.where(is_k, h - HEADS, 0)
        tl.store(k_ptr + (tok * KV_HEADS + k_head[:, None]) * DIM + d[None, :], out,
                 mask=is_k[:, None] & d_ok[None, :])
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        if slot >= 0:
            where = cache_ptr + slot * stride_slot + k_head[:, None] * DIM + d[None, :]
            tl.store(where, out, mask=is_k[:, None] & d_ok[None, :])
            v = tl.load(row + (h[:, None] + KV_HEADS) * DIM + d[None, :],
                        mask=is_k[:, None] & d_ok[None, :], other=0.0)
            tl.store(where + stride_plane, v, mask=is_k[:, None] & d_ok[None, :])

    @triton.jit
    def silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = i < width
        g = tl.load(gate_up_ptr + row * 2 * width + i, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + row * 2 * width + width + i, mask=ok, other=0.0)
        silu = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # rounded as HF's F.silu, then the product
        tl.store(out_ptr + row * width + i, (silu.to(tl.float32) * u.to(tl.float32)).to(u.dtype),
                 mask=ok)

    return {"norm": norm_kernel, "rope": rope_write_kernel, "silu": silu_mul_kernel}


class GpuLayerOps:
    """kernels.layer_ops' interface over the Triton kernels above."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return GpuLayerOps._norm(x, None, weight, eps)[1]

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return GpuLayerOps._norm(x, delta, weight, eps)

    @staticmethod
    def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        width = weight.shape[0]
        x = x.contiguous()
        y = torch.empty_like(x)
        total = torch.empty_like(x) if delta is not None else x
        rows = x.numel() // width
        if rows:
            _kernels()["norm"][(rows,)](
                x, delta.contiguous() if delta is not None else x, weight, total, y, width, eps,
                HAS_DELTA=delta is not None, BLOCK=pow2(width))
        return total, y

    @staticmethod
    def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache: torch.Tensor, slots: torch.Tensor, heads: int,
                      kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2K) D] (rows contiguous), cos and sin [T, 1, D]: q [T, H, D] and k
        [T, K, D] rotated; k and v written to cache [2, S, K, D] at slots (none where < 0)."""
        t, dim = qkv.shape[0], cache.shape[-1]
        q = qkv.new_empty(t, heads, dim)
        k = qkv.new_empty(t, kv_heads, dim)
        if t:
            cos, sin = cos.reshape(t, dim), sin.reshape(t, dim)
            if qkv.stride(1) != 1:
                qkv = qkv.contiguous()
            _kernels()["rope"][(t,)](
                qkv, cos, sin, cache, slots, q, k, qkv.stride(0), cos.stride(0),
                cache.stride(0), cache.stride(1), HEADS=heads, KV_HEADS=kv_heads, DIM=dim,
                ROWS_PAD=pow2(heads + kv_heads), DIM_PAD=pow2(dim))
        return q, k

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        t, width = gate_up.shape[0], gate_up.shape[1] // 2
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(t, width)
        block = min(pow2(width), 1024)
        if t:
            _kernels()["silu"][(t, -(-width // block))](gate_up, out, width, BLOCK=block)
        return out


OPS = GpuLayerOps()


def ops(x: torch.Tensor) -> GpuLayerOps | None:
    """The ops for `x`, where the kernels run on its device (models.gpu_attention.supports)."""
    return OPS if gpu_attention.supports(x) else None
