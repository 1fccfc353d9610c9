"""Packed projections that keep their plain weights for one-token calls, and the measured choice
between the two kernels at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from python_backends.engine.llm_engine import LLMEngine
from python_backends.models.llama import LlamaForCausalLM
from python_backends.parallel import layers
from python_backends.parallel.layers import Linear, one_token_seconds, plain_reads_faster
from python_backends.params import SamplingParams
from tests.conftest import TinyModel, prompts


def packed_linear(keep_plain: bool) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(0)
    m = Linear(64, 96, bias=False)
    weight = m.weight.detach().clone()
    assert m.pack(keep_plain=keep_plain)
    return m, weight


def test_one_token_reads_the_plain_weight_and_more_tokens_the_packed_one() -> None:
    m, weight = packed_linear(keep_plain=True)
    one, many = torch.randn(1, 64), torch.randn(5, 64)
    assert torch.equal(m(one), F.linear(one, weight))  # exactly the plain product
    packed = layers._packed_linear(many, m.packed)  # type: ignore[arg-type]
    assert torch.equal(m(many), packed)
    torch.testing.assert_close(m(many), F.linear(many, weight), rtol=1e-4, atol=1e-4)
    assert m.weight.numel() == 0  # the parameter itself is freed either way


def test_without_keep_plain_only_the_packed_weight_is_kept() -> None:
    m, weight = packed_linear(keep_plain=False)
    assert m.plain is None and m.packed is not None
    torch.testing.assert_close(m(torch.ones(1, 64)), F.linear(torch.ones(1, 64), weight),
                               rtol=1e-4, atol=1e-4)


def test_the_measured_choice_keeps_plain_weights_only_when_clearly_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m, _ = packed_linear(keep_plain=True)
    plain_s, packed_s = one_token_seconds([m], True), one_token_seconds([m], False)
    assert 0 < plain_s < 1 and 0 < packed_s < 1
    for plain, packed, wins in ((0.8, 1.0, True), (0.97, 1.0, False), (2.0, 1.0, False)):
        monkeypatch.setattr(layers, "one_token_seconds",
                            lambda _l, use_plain, repeats, p=plain, q=packed: p if use_plain else q)
        assert plain_reads_faster([m]) == (wins, plain, packed)


def test_the_choice_times_both_kernels_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of load during one kernel's timings must not decide: each kernel's best over
    alternating rounds counts."""
    m, _ = packed_linear(keep_plain=True)
    order: list[bool] = []
    # the plain kernel's first timing falls in a burst (5.0); its later ones are clean (0.5)
    times = {True: iter([5.0, 0.5, 0.5, 0.5]), False: iter([1.0, 1.0, 1.0, 1.0])}

    def timed(_l: list[Linear], use_plain: bool, repeats: int) -> float:
        order.append(use_plain)
        return next(times[use_plain])

    monkeypatch.setattr(layers, "one_token_seconds", timed)
    assert plain_reads_faster([m]) == (True, 0.5, 1.0)
    assert order == [True, False] * 4


@pytest.mark.parametrize("plain_wins", [True, False])
def test_an_engine_keeps_plain_weights_as_measured_and_matches_hf(
    tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch, plain_wins: bool,
) -> None:
    import python_backends.models.llama as llama

    monkeypatch.setattr(llama, "plain_reads_faster", lambda _l: (plain_wins, 1.0, 1.0))
    engine = tiny_llama.engine()
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.one_token_plain is plain_wins
    assert all((m.plain is not None) is plain_wins and m.packed is not None for m in linears)
    batch = prompts(3)
    seqs = [engine.add_request(f"s{i}", p, SamplingParams(max_tokens=6))
            for i, p in enumerate(batch)]
    while engine.has_unfinished:
        engine.step()
    assert [s.output_ids for s in seqs] == [tiny_llama.greedy(p, 6) for p in batch]


def test_keep_plain_can_be_forced_either_way_and_16_bit_engines_never_keep_it(
    tiny_llama: TinyModel,
) -> None:
    cfg = tiny_llama.engine().config.model
    for keep in (True, False):
        model = LlamaForCausalLM(cfg)
        model.pack_linears(keep_plain=keep)
        assert model.one_token_plain is keep
    if layers.packable(torch.bfloat16):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.pack_linears(keep_plain=True)
        assert not model.one_token_plain
        assert all(m.plain is None for m in model.modules() if isinstance(m, Linear))


def test_engines_load_with_the_measured_choice(tiny_llama: TinyModel) -> None:
    engine = LLMEngine.from_engine_dir(tiny_llama.engine_dir, num_kv_blocks=16)
    model = engine.runner.model
    kept = {m.plain is not None for m in model.modules() if isinstance(m, Linear)}
    assert kept == {model.one_token_plain}
