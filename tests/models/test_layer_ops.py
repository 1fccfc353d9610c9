"""The native float32 glue between a layer's projections (csrc/layer_ops.cpp) against the torch
ops it replaces (python_backends/models/common.py's and decoder.py's fallback paths)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from python_backends.config import RopeScaling
from python_backends.models import kernels
from python_backends.models.common import RotaryEmbedding, apply_rotary


@pytest.fixture(scope="module")
def ops():
    assert kernels.load(), "the native kernels did not build here (see the warning logged)"
    return torch.ops.llm_kernels


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (3, 2, 64), (5, 37), (0, 576)])
def test_rms_norm_matches_torch(ops, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5))
    delta = torch.randn(*shape, generator=g)
    total, normed = ops.add_rms_norm(x, delta, w, 1e-5)
    close(total, x + delta)
    close(normed, F.rms_norm(x + delta, (shape[-1],), w, 1e-5))


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (13, 4, 2, 32),
                                                                   (4, 2, 2, 6)])
def test_rope_write_kv_matches_torch(ops, tokens, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(tokens * heads)
    rope = RotaryEmbedding(dim, 512, 10000.0, RopeScaling())
    positions = torch.randint(0, 512, (tokens,), generator=g)
    rotary = rope(positions, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    slots = torch.randperm(64, generator=g)[:tokens]
    cache = torch.full((2, 64, kv_heads, dim), 7.0)
    q, k = ops.rope_write_kv(qkv, *rotary, cache, slots, heads, kv_heads)

    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref = apply_rotary(q_ref.view(tokens, heads, dim), rotary)
    k_ref = apply_rotary(k_ref.view(tokens, kv_heads, dim), rotary)
    close(q, q_ref)
    close(k, k_ref)
    close(cache[0, slots], k_ref)
    close(cache[1, slots], v_ref.reshape(tokens, kv_heads, dim))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert (cache[:, untouched] == 7.0).all()


@pytest.mark.parametrize(("tokens", "inner"), [(1, 1536), (9, 1536), (3, 21), (0, 16)])
def test_silu_mul_matches_torch(ops, tokens, inner):
    g = torch.Generator().manual_seed(tokens + inner)
    gate_up = torch.randn(tokens, 2 * inner, generator=g) * 8  # far into both tails
    gate, up = gate_up.chunk(2, dim=-1)
    close(ops.silu_mul(gate_up), F.silu(gate) * up)


def test_refuses_bad_arguments(ops):
    cache = torch.zeros(2, 8, 2, 4)
    qkv, cos, sin = torch.randn(2, 24), torch.ones(2, 4), torch.zeros(2, 4)
    cases = [
        (lambda: ops.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-5), "for a weight of 4"),
        (lambda: ops.rms_norm(torch.randn(2, 8).double(), torch.ones(8), 1e-5), "float32"),
        (lambda: ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5),
         "delta"),
        (lambda: ops.rope_write_kv(qkv, cos, sin, cache, torch.tensor([0, 8]), 2, 2),
         "slot 8 outside"),
        (lambda: ops.rope_write_kv(qkv, cos, sin, cache, torch.tensor([0, -1]), 2, 2),
         "slot -1 outside"),
        (lambda: ops.rope_write_kv(qkv, cos, sin, cache, torch.tensor([0]), 2, 2), "slots"),
        (lambda: ops.rope_write_kv(qkv, cos, sin, cache, torch.tensor([0, 1]), 3, 2), "qkv"),
        (lambda: ops.silu_mul(torch.randn(2, 5)), "gate_up"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
    assert (cache == 0).all()  # a refused call writes nothing


def test_engines_use_them_only_for_float32_cpu_tensors():
    assert kernels.layer_ops(torch.zeros(2)) is not None
    assert kernels.layer_ops(torch.zeros(2, dtype=torch.bfloat16)) is None
