"""Prompts' attention on AMX tiles (csrc/prompt_attention.cpp) against float64 and torch's SDPA,
and the dispatch that takes it (models/attention.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from python_backends.models import attention, kernels
from python_backends.models.attention import AttentionMetadata, causal_mask

pytestmark = pytest.mark.skipif(not kernels.load() or kernels.prompt_attention() is None,
                                reason="no AMX tiles here: prompts' attention stays in SDPA")


@pytest.fixture
def ops():
    return torch.ops.llm_kernels


def case(n: int, context: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n queries over `context` keys and values (the queries the last n), values of a model's
    scale: scores of a few units."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, head_dim, generator=g)
    k = torch.randn(context, kv_heads, head_dim, generator=g)
    v = torch.randn(context, kv_heads, head_dim, generator=g)
    return q, k, v


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float) -> torch.Tensor:
    """torch's SDPA over one prompt, [n, H, D] (causal where `mask` is None), in q's dtype."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        is_causal=mask is None, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def run(ops, q, prompts, scale):
    """The kernel over prompts of (start, end, k, v, mask or None) of q's rows."""
    out = torch.full_like(q, float("nan"))
    spans = [b for start, end, *_ in prompts for b in (start, end)]
    ops.prompt_attention(q, out, spans, [p[2] for p in prompts], [p[3] for p in prompts],
                         [p[4] if p[4] is not None else torch.empty(0, dtype=torch.bool)
                          for p in prompts], scale)
    return out


# (queries, keys): alone (causal over their own), after a cached context, one query; partial
# row tiles and key panels, several passes of 32 rows, keys past one panel.
SHAPES = [(1, 1), (5, 5), (33, 33), (100, 100), (300, 300), (7, 150), (40, 97), (1, 64)]


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 32])
@pytest.mark.parametrize(("n", "context"), SHAPES)
def test_matches_float64_as_closely_as_torch_sdpa(ops, heads, kv_heads, head_dim, n, context):
    """Within float32's precision: no further from the float64 result than torch's own float32
    kernel is, give or take a few roundings."""
    q, k, v = case(n, context, heads, kv_heads, head_dim, seed=n + context)
    scale = head_dim**-0.5
    mask = None if n == context else causal_mask(n, context)
    got = run(ops, q, [(0, n, k, v, mask)], scale)
    want = sdpa(q.double(), k.double(), v.double(), mask, scale)
    torch_error = (sdpa(q, k, v, mask, scale).double() - want).abs().max().item()
    error = (got.double() - want).abs().max().item()
    assert error <= 4 * torch_error + 1e-6, (error, torch_error)


def test_several_prompts_in_one_call_each_into_its_rows(ops):
    """A step's prompts: one alone, one after a cached context, one under a sliding window
    (an explicit mask); the rows between them left as they were."""
    heads, kv_heads, head_dim, scale = 9, 3, 64, 0.125
    q = torch.randn(120, heads, head_dim, generator=torch.Generator().manual_seed(3))
    prompts = []
    for start, end, context, seed in ((0, 40, 40, 1), (45, 90, 130, 2), (90, 120, 30, 4)):
        _, k, v = case(end - start, context, heads, kv_heads, head_dim, seed=seed)
        mask = None if start == 0 else causal_mask(end - start, context)
        if start == 90:
            mask = attention.window_mask(0, 30, 8)  # each query its last 8 keys
        prompts.append((start, end, k, v, mask))
    got = run(ops, q, prompts, scale)
    for start, end, k, v, mask in prompts:
        want = sdpa(q[start:end].double(), k.double(), v.double(), mask, scale)
        torch.testing.assert_close(got[start:end].double(), want, atol=2e-5, rtol=2e-5)
    assert got[40:45].isnan().all()


def test_results_do_not_depend_on_who_computed_them(ops):
    q, k, v = case(300, 300, 9, 3, 64, seed=5)
    q2, k2, v2 = case(200, 260, 9, 3, 64, seed=6)
    both = torch.cat([q, q2])
    prompts = [(0, 300, k, v, None), (300, 500, k2, v2, causal_mask(200, 260))]
    before = ops.set_idle_helper(False)
    try:
        alone = run(ops, both, prompts, 0.125)
    finally:
        ops.set_idle_helper(before)
    assert torch.equal(run(ops, both, prompts, 0.125), alone)


def test_refuses_bad_arguments(ops):
    q, k, v = case(4, 4, 4, 2, 64)
    none = torch.empty(0, dtype=torch.bool)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="head size a multiple of 32"):
        ops.prompt_attention(q[..., :48].contiguous(), out[..., :48].contiguous(), [0, 4],
                             [k[..., :48]], [v[..., :48]], [none], 1.0)
    with pytest.raises(RuntimeError, match="span out of range"):
        ops.prompt_attention(q, out, [2, 9], [k], [v], [none], 1.0)
    with pytest.raises(RuntimeError, match="fewer keys than queries"):
        ops.prompt_attention(q, out, [0, 4], [k[:3]], [v[:3]], [none], 1.0)
    with pytest.raises(RuntimeError, match=r"mask bool \[n, L\]"):
        ops.prompt_attention(q, out, [0, 4], [k], [v], [torch.ones(4, 5, dtype=torch.bool)], 1.0)
    with pytest.raises(RuntimeError, match="query heads over"):
        ops.prompt_attention(q, out, [0, 4], [k[:, :1].expand(4, 3, 64).contiguous()],
                             [v[:, :1].expand(4, 3, 64).contiguous()], [none], 1.0)
    with pytest.raises(RuntimeError, match="each prompt"):
        ops.prompt_attention(q, out, [0, 4], [k], [v], [], 1.0)


def test_paged_attention_takes_the_tiles_for_float32_prompts(monkeypatch):
    """models/attention.py: float32 prompts without a softcap go to the kernel (SDPA is not
    called), and the result is the kernel's; a softcap, or bfloat16, keeps SDPA."""
    n, heads, kv_heads, head_dim = 20, 4, 2, 64
    q, k, v = case(n, n, heads, kv_heads, head_dim, seed=7)
    cache = torch.zeros(2, n, kv_heads, head_dim)
    attention.write_kv(cache, k, v, torch.arange(n))
    meta = AttentionMetadata.one_prompt(n)
    calls: list[int] = []
    real = attention.sdpa

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa", counted)
    got = attention.paged_attention(q, k, v, cache, meta, 0.125)
    assert not calls
    assert torch.equal(got, run(torch.ops.llm_kernels, q, [(0, n, k, v, None)], 0.125))
    attention.paged_attention(q, k, v, cache, meta, 0.125, softcap=30.0)
    attention.paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.bfloat16(), meta,
                              0.125)
    assert len(calls) == 2
