"""Greedy tokens by screening the LM head (models/greedy_head.py, csrc/linear.cpp's screen_*):
the same token as the argmax of every float32 logit, on data with near ties, exact ties and
large and small norms."""

from __future__ import annotations

import pytest
import torch

from python_backends.models import kernels
from python_backends.models.greedy_head import (
    FEW_ROWS,
    GreedyHead,
    quantize_groups,
    rounded,
)

pytestmark = pytest.mark.skipif(not kernels.screen_path(),
                                reason="the screen computes on AMX tiles or AVX-512 VNNI only")


def _argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each row's first largest float32 logit over every token, computed as the head computes
    its candidates'."""
    rows = torch.arange(x.shape[0]).repeat_interleave(weight.shape[0])
    cols = torch.arange(weight.shape[0]).repeat(x.shape[0])
    return torch.ops.llm_kernels.candidate_argmax(x, weight, rows, cols)


def test_candidates_logits_are_float32_dot_products():
    torch.manual_seed(3)
    x, w = torch.randn(4, 100), torch.randn(300, 100)
    exact = (x.double() @ w.double().T).max(dim=1)
    got = _argmax(x, w)
    chosen = (x.double() * w[got].double()).sum(dim=1)
    slack = 2 * 102 * 2.0 ** -24 * x.norm(dim=1).double() * w.norm(dim=1).max().double()
    assert (chosen >= exact.values - slack).all()
    rows, cols = torch.tensor([0, 0, 2]), torch.tensor([5, 9, 7])
    picked = torch.ops.llm_kernels.candidate_argmax(x, w, rows, cols)
    first = 5 if float(x[0] @ w[5]) >= float(x[0] @ w[9]) else 9
    assert picked.tolist() == [first, 300, 7, 300]  # rows without candidates: the vocab size
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.llm_kernels.candidate_argmax(x, w, torch.tensor([4]), torch.tensor([0]))


@pytest.mark.parametrize("rows,vocab,k", [(1, 100, 64), (5, 4099, 576), (33, 2000, 100),
                                          (70, 3000, 576), (13, 33, 7)])
def test_screen_is_the_rounded_operands_product(rows, vocab, k):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, k), torch.randn(vocab, k)
    w[3] = 0  # a token whose row is all zeros
    x[:, : min(k, 40)] *= 30  # a few large channels, as hidden states have
    head = GreedyHead.build(w)
    assert head is not None
    screen = head.screen_for(rows)
    x0, got = screen.estimate(x, vocab)
    assert torch.equal(x0, rounded(x, screen.path))
    w0 = rounded(w, screen.path)
    exact = x0.double() @ w0.double().T
    bound = 2 * (k + 2) * 2.0 ** -24 * (x0.abs().double() @ w0.abs().double().T)
    assert ((got.double() - exact).abs() <= bound).all()


def test_steps_of_few_rows_screen_on_int8_beside_amx():
    head = GreedyHead.build(torch.randn(100, 64))
    assert head is not None and head.paths == kernels.screen_paths()
    few, many = head.screen_for(FEW_ROWS), head.screen_for(FEW_ROWS + 1)
    assert many.path == kernels.screen_path()
    if kernels.screen_paths() == ("amx", "avx512_vnni"):  # every CPU with tiles has VNNI
        assert few.path == "avx512_vnni" and head.screen_for(1) is few
    else:
        assert few is many and head.few_rows is None


def test_int8_groups_round_each_group_on_its_own_scale():
    x = torch.cat([torch.full((1, 64), 100.0), torch.linspace(-1, 1, 70).unsqueeze(0)], dim=1)
    q, scales, x0 = quantize_groups(x)
    assert q.shape == (1, 192) and scales.shape == (1, 3)
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    assert scales[0].tolist() == pytest.approx([100 / 127, 1 / 127, 1 / 127])
    assert (q[0, 134:] == 0).all()  # the padding is zero
    assert (x0 - x).abs().max() <= 0.5 / 127 * 100 * (1 + 1e-6)
    assert (x0[0, 64:] - x[0, 64:]).abs().max() <= 0.5 / 127 * (1 + 1e-6)  # not 100's scale


def test_tokens_are_the_float32_argmax_with_near_ties():
    torch.manual_seed(0)
    vocab, k = 6000, 576
    weight = torch.randn(vocab, k) * 0.05
    # Rows a hair apart: their logits differ below the screen's error, so all are candidates.
    weight[1000:1040] = weight[999] + 1e-6 * torch.randn(40, k)
    head = GreedyHead.build(weight)
    assert head is not None
    x = torch.randn(24, k) * torch.logspace(-3, 3, 24).unsqueeze(1)  # norms 1e-3 .. 1e3
    x[:8] = weight[999] * 40 + 1e-3 * torch.randn(8, k)  # pointing at the near-tied rows
    for rows in (x, x[:FEW_ROWS], x[6:7]):  # the screen for many rows and for few
        tokens = head.tokens(rows)
        assert tokens is not None and torch.equal(tokens, _argmax(rows, weight))


def test_exact_ties_go_to_the_lowest_index():
    torch.manual_seed(1)
    weight = torch.randn(500, 64)
    weight[300] = weight[420] = weight[17]
    head = GreedyHead.build(weight)
    assert head is not None
    tokens = head.tokens(weight[17:18] * 3)
    assert tokens is not None and tokens.tolist() == [17]


def test_tokens_of_no_rows():
    head = GreedyHead.build(torch.randn(50, 64))
    assert head is not None
    tokens = head.tokens(torch.empty(0, 64))
    assert tokens is not None and tokens.shape == (0,)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_rows_are_left_to_the_full_head(value):
    head = GreedyHead.build(torch.randn(50, 64))
    assert head is not None
    x = torch.randn(3, 64)
    x[1, 5] = value
    assert head.tokens(x) is None


def test_only_float32_cpu_weights():
    assert GreedyHead.build(torch.randn(50, 64).double()) is None
    assert GreedyHead.build(torch.randn(50, 64, 2)) is None


def test_candidates_refuse_mismatched_shapes():
    ops = torch.ops.llm_kernels
    estimate, a = torch.randn(3, 40), torch.ones(3)
    with pytest.raises(RuntimeError, match="screen_candidates"):
        ops.screen_candidates(estimate, a, a, torch.ones(39), torch.ones(40))
    with pytest.raises(RuntimeError, match="screen_candidates"):
        ops.screen_candidates(estimate.double(), a, a, torch.ones(40), torch.ones(40))
    if kernels.screen_path() == "amx":
        with pytest.raises(RuntimeError, match="pack_screen_weight"):
            ops.screen_linear(torch.randn(3, 64), torch.zeros(2, 5, dtype=torch.short), 40)
    else:
        xq, scales = torch.zeros(3, 64, dtype=torch.uint8), torch.ones(3, 1)
        with pytest.raises(RuntimeError, match="pack_int8_screen"):
            ops.int8_screen(xq, scales, torch.zeros(2, 5, dtype=torch.uint8), 40)
        with pytest.raises(RuntimeError, match="xs float32"):
            ops.int8_screen(xq, torch.ones(3, 2), torch.zeros(2, 5, dtype=torch.uint8), 40)
