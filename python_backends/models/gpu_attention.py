"""Paged attention on GPUs, in the Triton language: decode queries read the KV cache in place
through each sequence's block table, and the step's keys and values are written into it.

Both kernels take their sizes from tensors (context lengths, block tables, slots), never from
Python values that change per step, so a decode step that uses them can be captured once as a
CUDA graph and replayed for any step of the same row count (engine.cuda_graphs). A row whose
slot is negative writes nothing and a row of context length 0 reads nothing: that is how the
graph's padding rows stay out of the cache.

Shapes: B decode rows, H query heads, K KV heads (H = K * G), D head size, S slots in the cache,
M blocks a row's table holds (max_seq_len / block_size), T tokens written.

Triton runs them on CPU tensors too when TRITON_INTERPRET=1 is set before it is imported (the
CPU suite tests them so: tests/models/test_gpu_attention.py).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

import torch

# Tokens of context one program reads per iteration (a few blocks of 16): enough loads in
# flight for the memory system. A first version multiplied the group's queries by the keys as
# a broadcast G x N x D product in registers; the two matrix products per iteration took a
# 30-layer model's replayed decode step on an H200 from 2.85 to 2.36 ms at batch 1.
TOKENS_PER_ITER = 64


@functools.cache
def _triton() -> ModuleType | None:
    try:
        import triton
    except ImportError:
        return None
    return triton


def available() -> bool:
    """Whether Triton is installed (it comes with torch's CUDA builds)."""
    return _triton() is not None


def supports(t: torch.Tensor) -> bool:
    """Whether these kernels run on `t` (contiguous): on CUDA with Triton, or on any device
    under the interpreter (TRITON_INTERPRET=1). A CPU engine never imports Triton here."""
    if not (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return t.is_contiguous() and available()


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Defined on first use: importing triton.language is not free, and CPU engines never do."""
    triton = _triton()
    assert triton is not None
    import triton.language as tl

    @triton.jit
    def decode_kernel(
        q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, scale, softcap,
        stride_qb, stride_qh, stride_plane, stride_slot, stride_head, stride_tb,
        stride_ob, stride_oh,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TOKENS: tl.constexpr,
        SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        n_ctx = tl.load(lens_ptr + row)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUP + g
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        t = tl.arange(0, TOKENS)
        for first in range(0, n_ctx, TOKENS):
            pos = first + t
            t_ok = pos < n_ctx
            block = tl.load(tables_ptr + row * stride_tb + pos // BLOCK_SIZE, mask=t_ok,
                            other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            where = slot[:, None] * stride_slot + kv_head * stride_head + d[None, :]
            ok = t_ok[:, None] & d_ok[None, :]
            k = tl.load(cache_ptr + where, mask=ok, other=0.0).to(tl.float32)
            v = tl.load(cache_ptr + stride_plane + where, mask=ok, other=0.0).to(tl.float32)
            # The group's queries as one matrix product (GROUP_PAD >= 16 rows): on the tensor
            # cores in TF32 for 16-bit caches (their values are exact in it; the weights p are
            # rounded to it), in full float32 ("ieee") for float32 ones.
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, N]
            if SOFTCAP:  # softcap * tanh(s / softcap), tanh written with exp
                s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
            s = tl.where(t_ok[None, :], s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, axis=1))
            p = tl.exp(s - new_best[:, None])
            keep = tl.exp(best - new_best)
            total = total * keep + tl.sum(p, axis=1)
            acc = acc * keep[:, None] + tl.dot(p, v, input_precision=PRECISION)
            best = new_best
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def write_kernel(
        k_ptr, v_ptr, cache_ptr, slots_ptr, stride_kt, stride_vt, stride_plane, stride_slot,
        WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr,
    ):
        tok = tl.program_id(0)
        slot = tl.load(slots_ptr + tok).to(tl.int64)
        if slot >= 0:
            i = tl.arange(0, WIDTH_PAD)
            ok = i < WIDTH
            k = tl.load(k_ptr + tok * stride_kt + i, mask=ok)
            v = tl.load(v_ptr + tok * stride_vt + i, mask=ok)
            tl.store(cache_ptr + slot * stride_slot + i, k, mask=ok)
            tl.store(cache_ptr + stride_plane + slot * stride_slot + i, v, mask=ok)

    return decode_kernel, write_kernel


def pow2(n: int) -> int:
    """The least power of two >= n (a Triton block's size), 1 for n <= 1."""
    return 1 << max(n - 1, 0).bit_length()


def decode_attention(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, block_size: int, scale: float,
                     softcap: float = 0.0) -> torch.Tensor:
    """One query per row over the first lens[b] tokens of its sequence, whose blocks are
    tables[b] (int32). q: [B, H, D]; cache: [2, S, K, D] contiguous. Returns [B, H, D] in q's
    dtype; a row of length 0 gets zeros."""
    decode_kernel, _ = _kernels()
    b, h, d = q.shape
    k = cache.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    group = h // k
    decode_kernel[(b, k)](
        q, cache, tables, lens, out, scale, softcap or 1.0,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
        tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(pow2(group), 16), HEAD_DIM=d,
        DIM_PAD=max(pow2(d), 16), TOKENS=max(TOKENS_PER_ITER, pow2(block_size)),
        SOFTCAP=bool(softcap), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """cache[0][slots[t]] = k[t], cache[1][slots[t]] = v[t] for every t whose slot is >= 0.
    cache: [2, S, K, D] contiguous; k, v: [T, K, D]."""
    _, write_kernel = _kernels()
    t = k.shape[0]
    if t == 0:
        return
    k = k.reshape(t, -1)
    v = v.reshape(t, -1)
    if k.stride(1) != 1 or v.stride(1) != 1:
        k, v = k.contiguous(), v.contiguous()
    width = k.shape[1]
    write_kernel[(t,)](k, v, cache, slots, k.stride(0), v.stride(0), cache.stride(0),
                       cache.stride(1), WIDTH=width, WIDTH_PAD=pow2(width))
