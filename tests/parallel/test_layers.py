"""Packed projections: oneDNN's, which keep their plain weights for one-token calls where that is
measured faster, and the native kernel's, which one-thread engines use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from python_backends.engine.llm_engine import LLMEngine
from python_backends.host_memory import HUGE_PAGE
from python_backends.models import kernels
from python_backends.models.decoder import CausalLM
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


def assert_greedy_matches_hf(engine: LLMEngine, tiny_llama: TinyModel,
                             batch: list[list[int]] | None = None) -> None:
    batch = batch or prompts(3)
    seqs = [engine.add_request(f"s{i}", p, SamplingParams(max_tokens=6))
            for i, p in enumerate(batch)]
    while engine.has_unfinished:
        engine.step()
    assert [s.output_ids for s in seqs] == [tiny_llama.greedy(p, 6) for p in batch]


@pytest.mark.parametrize("plain_wins", [True, False])
def test_an_engine_keeps_plain_weights_as_measured_and_matches_hf(
    tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch, plain_wins: bool,
) -> None:
    import python_backends.models.decoder as decoder

    monkeypatch.setattr(decoder, "plain_reads_faster", lambda _l: (plain_wins, 1.0, 1.0))
    monkeypatch.setattr(decoder.kernels, "native_linear", lambda: None)  # oneDNN's path
    monkeypatch.setattr(decoder.kernels, "layer_ops", lambda _x: None)  # and torch's glue
    engine = tiny_llama.engine()
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.one_token_plain is plain_wins
    assert all((m.plain is not None) is plain_wins and m.packed is not None for m in linears)
    assert_greedy_matches_hf(engine, tiny_llama)


def test_keep_plain_can_be_forced_either_way_and_16_bit_engines_never_keep_it(
    tiny_llama: TinyModel,
) -> None:
    cfg = tiny_llama.engine().config.model
    for keep in (True, False):
        model = CausalLM(cfg)
        model.pack_linears(keep_plain=keep, native=False)
        assert model.one_token_plain is keep
    if layers.packable(torch.bfloat16):
        model = CausalLM(cfg).to(torch.bfloat16)
        model.pack_linears(keep_plain=True, native=True)  # no native kernel for 16-bit weights
        assert not model.one_token_plain and not model.native_linears
        assert all(m.plain is None for m in model.modules() if isinstance(m, Linear))


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Engines set torch's threads for the whole process: put them back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_engines_load_with_the_measured_choice(tiny_llama: TinyModel, torch_threads: None) -> None:
    engine = LLMEngine.from_engine_dir(tiny_llama.engine_dir, num_kv_blocks=16, cpu_threads=2)
    model = engine.runner.model
    kept = {m.plain is not None for m in model.modules() if isinstance(m, Linear)}
    assert kept == {model.one_token_plain} and not model.native_linears


def test_one_thread_engines_compute_projections_natively_and_match_hf(
    tiny_llama: TinyModel, torch_threads: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer by layer, as the profiler sees each operator (the stack calls the same kernels
    from C++, and tests/models/test_decoder_stack.py holds it to this path bit for bit)."""
    assert kernels.load(), "the native kernels did not build here (see the warning logged)"
    monkeypatch.setenv(kernels.STACK_ENV, "0")
    engine = LLMEngine.from_engine_dir(tiny_llama.engine_dir, num_kv_blocks=128, cpu_threads=1)
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.native_linears
    assert all(m.native is not None and m.packed is None and m.plain is None
               and m.weight.numel() == 0 for m in linears)
    # All in one huge-page mapping, in the order a step reads them.
    starts = [m.native.data_ptr() for m in linears if m.native is not None]
    assert starts == sorted(starts) and starts[0] % HUGE_PAGE == 0
    assert len({m.native.untyped_storage().data_ptr() for m in linears
                if m.native is not None}) == 1
    before = engine.stats()
    with torch.profiler.profile() as profile:
        assert_greedy_matches_hf(engine, tiny_llama)
    # Prompts of 50 tokens and more: on AMX tiles where the CPU has them (test_linear.py).
    assert_greedy_matches_hf(engine, tiny_llama, prompts(3, lo=50, hi=90))
    ran = {event.key for event in profile.key_averages()}
    glue = {f"llm_kernels::{op}" for op in ("add_rms_norm", "rope_write_kv", "silu_mul")}
    assert glue <= ran and "aten::index_copy_" not in ran  # the layers' glue ran natively too
    if kernels.screen_path():  # greedy rows' tokens came from the screened head
        assert model.greedy_head is not None
        few_rows = model.greedy_head.screen_for(1).path  # decode steps of few sequences
        op = {"amx": "screen_linear", "avx512_vnni": "int8_screen"}[few_rows]
        assert f"llm_kernels::{op}" in ran
    after = engine.stats()  # the kernels' work shows in the stats the metrics publish
    assert after.kernel_chunks > before.kernel_chunks
    assert 0 <= after.helper_chunks - before.helper_chunks <= after.kernel_chunks
    assert after.helper_taken_back >= before.helper_taken_back
    # the helper counts a heavy job once it is SCHED_IDLE again, maybe after the step returned
    assert before.helper_boosted <= after.helper_boosted <= kernels.helper_stats().boosted


def fake_op(x: torch.Tensor, packed: torch.Tensor, out_features: int,
            blocks: torch.Tensor | None, kind: str) -> torch.Tensor:
    assert x.dim() == 2 and blocks is None and kind == ""
    return F.linear(x, packed)[:, :out_features]


def test_pack_native_hands_rows_to_the_op_and_keeps_the_shape() -> None:
    torch.manual_seed(0)
    m = Linear(64, 96, bias=False)
    weight = m.weight.detach().clone()
    assert m.pack_native(lambda w: w.clone(), fake_op)
    assert m.weight.numel() == 0 and m.input_dtype == torch.float32
    x = torch.randn(2, 3, 64)
    assert torch.equal(m(x), F.linear(x, weight))


def test_pack_native_refuses_what_the_kernel_cannot_compute() -> None:
    half = Linear(64, 96, bias=False).to(torch.bfloat16)
    assert not half.pack_native(lambda w: w, fake_op)
    assert half.native is None and half.weight.numel() == 64 * 96


def test_a_bias_is_added_on_every_path() -> None:
    """Qwen2's q/k/v biases: the packed, plain, native and int8 products each add it."""
    torch.manual_seed(0)
    ref = Linear(64, 96, bias=True)
    x = torch.randn(5, 64)
    want = F.linear(x, ref.weight, ref.bias)
    packed, plain, native = (Linear(64, 96, bias=True) for _ in range(3))
    for m in (packed, plain, native):
        m.load_state_dict(ref.state_dict())
    with torch.inference_mode():
        if packed.pack():
            torch.testing.assert_close(packed(x), want, atol=1e-4, rtol=1e-4)
        if plain.pack(keep_plain=True):
            torch.testing.assert_close(plain(x[:1]), want[:1], atol=1e-4, rtol=1e-4)
        assert native.pack_native(lambda w: w, fake_op)
        torch.testing.assert_close(native(x), want, atol=1e-4, rtol=1e-4)
