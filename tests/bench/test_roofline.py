"""The roofline: the model's arithmetic and weights counted from its projections, the bound's two
floors, and the engine driven alone, whose steps can never beat the floor the bound assumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from python_backends.bench.roofline import (
    Projections,
    Rates,
    StepRates,
    Workload,
    bound,
    decode_attention_seconds,
    drive,
    measure,
    measure_step,
    random_prompts,
    step_bound,
)
from python_backends.config import EngineLimits, ParallelLayout
from python_backends.engine.builder import write_engine
from python_backends.engine.llm_engine import LLMEngine
from python_backends.models import kernels
from python_backends.models.decoder import CausalLM
from python_backends.parallel.context import ParallelContext
from python_backends.parallel.layers import int8_supported
from tests.conftest import TinyModel, make_tiny_llama


def hf_counts(model: TinyModel) -> tuple[int, int]:
    """Weights of every projection but the LM head, and of the LM head, from Hugging Face."""
    body = sum(p.numel() for name, p in model.hf.named_parameters()
               if name.endswith("proj.weight"))
    return body, model.hf.lm_head.weight.numel()


def projections_of(model: TinyModel) -> Projections:
    return Projections.of(model.engine().runner.model)


def test_arithmetic_and_weights_are_those_of_the_model(tiny_llama: TinyModel) -> None:
    p = projections_of(tiny_llama)
    body, head = hf_counts(tiny_llama)
    assert p.flops_per_token == 2 * body
    assert p.lm_head_flops == 2 * head
    assert p.weight_bytes == 4 * (body + head)


def engine_as(tiny: TinyModel, out_dir: Path, dtype: str, weights: str = "") -> Projections:
    write_engine(tiny.hf, None, out_dir, EngineLimits(max_seq_len=256, block_size=4), dtype,
                 "random", log=lambda _m: None, weights=weights)
    return Projections.of(LLMEngine.from_engine_dir(out_dir, num_kv_blocks=16).runner.model)


def test_a_bfloat16_engine_reads_half_the_bytes(tiny_llama: TinyModel, tmp_path: Path) -> None:
    p = engine_as(tiny_llama, tmp_path / "bf16", "bfloat16")
    body, head = hf_counts(tiny_llama)
    assert p.weight_bytes == 2 * (body + head)


@pytest.mark.skipif(int8_supported() is not None, reason=str(int8_supported()))
def test_int8_projections_count_one_byte_per_weight(tiny_llama: TinyModel,
                                                    tmp_path: Path) -> None:
    p = engine_as(tiny_llama, tmp_path / "int8", "float32", weights="int8")
    body, head = hf_counts(tiny_llama)
    kept = sum(m.weight.numel() for name, m in tiny_llama.hf.named_modules()
               if name.endswith(CausalLM.FLOAT_IN_INT8))
    assert kept > head  # the down projections and the LM head stay float32
    assert p.weight_bytes == (body + head - kept) + 4 * kept
    assert measure(p, prompt_rows=8, repeats=1).flops_per_s > 0  # int8 projections run too


def test_models_with_experts_are_refused(tmp_path: Path) -> None:
    cfg = make_tiny_llama(tmp_path / "e").engine().config.model
    moe = CausalLM(type(cfg)(**{**cfg.__dict__, "num_experts": 2,
                                        "num_experts_per_tok": 1}))
    with pytest.raises(ValueError, match="experts"):
        Projections.of(moe)


def test_multi_rank_engines_are_refused(tmp_path: Path) -> None:
    cfg = make_tiny_llama(tmp_path / "e").engine().config.model
    shard = CausalLM(cfg, ParallelContext(ParallelLayout(tp=2)))
    with pytest.raises(ValueError, match="2 ranks"):
        Projections.of(shard)


def test_the_bound_is_the_larger_floor_and_scales_with_cores(tiny_llama: TinyModel) -> None:
    p = projections_of(tiny_llama)
    w = Workload(prompt_tokens=10, output_tokens=4, concurrency=3, requests=7)
    assert w.min_steps == 3 * 4  # ceil(7 / 3) waves of 4 steps
    assert w.flops(p) == 7 * ((10 + 3) * p.flops_per_token + 4 * p.lm_head_flops)
    rates = Rates(flops_per_s=w.flops(p) / 2.0, step_read_s=0.1, prompt_rows=8)
    one, two = bound(w, p, rates), bound(w, p, rates, cores=2)
    assert (one.compute_s, one.read_s, one.limit) == (pytest.approx(2.0), pytest.approx(1.2),
                                                      "arithmetic")
    assert one.tokens_per_s == pytest.approx(28 / 2.0)
    assert two.seconds == pytest.approx(1.0) and two.tokens_per_s == pytest.approx(28.0)
    slow_reads = Rates(flops_per_s=rates.flops_per_s, step_read_s=0.5, prompt_rows=8)
    assert bound(w, p, slow_reads).limit == "weight reads"
    assert slow_reads.min_step_s(2) == 0.25
    with pytest.raises(ValueError):
        Workload(prompt_tokens=10, output_tokens=0, concurrency=1, requests=1)


def test_the_step_bound_adds_decode_attention_to_each_part_at_its_own_rate(
        tiny_llama: TinyModel) -> None:
    p = projections_of(tiny_llama)
    w = Workload(prompt_tokens=10, output_tokens=4, concurrency=3, requests=7)
    # Token i = 1, 2, 3 of each request reads its prompt and the i tokens before it.
    assert w.decode_slots == 7 * (11 + 12 + 13)
    assert w.mean_decode_context == 12
    rates = Rates(flops_per_s=7 * 10 * p.flops_per_token / 2.0, step_read_s=0.01, prompt_rows=8)
    step = StepRates(rows=3, body_flops_per_s=7 * 3 * p.flops_per_token / 1.0,
                     attention_s_per_slot=0.5 / w.decode_slots)
    one, two = step_bound(w, p, rates, step), step_bound(w, p, rates, step, cores=2)
    # prompts 2.0 s, decode rows 1.0 s (the LM head free), attention 0.5 s
    assert (one.compute_s, one.attention_s) == (pytest.approx(3.0), pytest.approx(0.5))
    assert one.seconds == pytest.approx(3.5) and one.limit == "arithmetic and decode attention"
    assert two.tokens_per_s == pytest.approx(2 * one.tokens_per_s) == pytest.approx(28 / 1.75)
    slow_reads = Rates(flops_per_s=rates.flops_per_s, step_read_s=1.0, prompt_rows=8)
    assert step_bound(w, p, slow_reads, step).limit == "weight reads"  # 12 steps of 1 s
    assert bound(w, p, rates).attention_s == 0 and bound(w, p, rates).limit == "arithmetic"


@pytest.mark.parametrize("native", [True, False])
def test_decode_attention_is_measured_on_either_path_and_grows_with_context(
        tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    if not native:  # no native kernels: the torch path the engine then takes
        monkeypatch.setattr(kernels, "paged_decode_attention", lambda: None)
    engine = tiny_llama.engine(num_kv_blocks=256)
    short = decode_attention_seconds(engine, rows=4, context=8)
    long = decode_attention_seconds(engine, rows=4, context=200)
    assert 0 < short < long < 1.0
    with pytest.raises(ValueError, match="KV blocks"):
        decode_attention_seconds(engine, rows=64, context=200)


def test_measured_step_rates_are_positive_and_finite(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine(num_kv_blocks=256)
    step = measure_step(engine, Projections.of(engine.runner.model), rows=4, context=32,
                        repeats=2)
    assert step.rows == 4
    assert 0 < step.body_flops_per_s < float("inf") and 0 < step.attention_s_per_slot < 1e-3


def test_attention_of_another_kind_gets_no_step_bound(tiny_llama: TinyModel,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Latent attention (DeepSeek's) reads another cache layout; this measures the heads'."""
    engine = tiny_llama.engine(num_kv_blocks=64)
    monkeypatch.setattr(engine.runner.model, "attention_layers", lambda: [object()])
    with pytest.raises(ValueError, match="latent attention"):
        decode_attention_seconds(engine, rows=2, context=16)


def test_measured_rates_are_positive_and_finite(tiny_llama: TinyModel) -> None:
    rates = measure(projections_of(tiny_llama), prompt_rows=16, repeats=2)
    assert 0 < rates.flops_per_s < float("inf")
    assert 0 < rates.step_read_s < 1.0
    if kernels.load():  # the ceiling the projections are read against
        assert rates.fma_peak_flops_per_s is not None and rates.fma_peak_flops_per_s > 0
    else:
        assert rates.fma_peak_flops_per_s is None


def test_driven_engine_serves_every_token_in_no_fewer_steps_than_the_floor(
    tiny_llama: TinyModel,
) -> None:
    engine = tiny_llama.engine(num_kv_blocks=256, enable_prefix_caching=False)
    w = Workload(prompt_tokens=12, output_tokens=5, concurrency=3, requests=7)
    driven = drive(engine, random_prompts(7, 12, 256), w)
    assert driven.output_tokens == 7 * 5
    assert driven.steps >= w.min_steps
    assert driven.phases["forward"] > 0 and driven.tokens_per_s > 0
    assert not engine.has_unfinished and engine.blocks.num_used == 0
    with pytest.raises(ValueError, match="prompts"):
        drive(engine, random_prompts(2, 12, 256), w)


def test_a_level_past_its_time_is_aborted(tiny_llama: TinyModel) -> None:
    engine = tiny_llama.engine(num_kv_blocks=256)
    w = Workload(prompt_tokens=8, output_tokens=50, concurrency=2, requests=4)
    with pytest.raises(TimeoutError):
        drive(engine, random_prompts(4, 8, 256), w, max_s=0.0)
    assert not engine.has_unfinished and engine.blocks.num_used == 0


def test_random_prompts_avoid_special_ids_and_repeat_by_seed() -> None:
    a = random_prompts(3, 20, 49152, seed=5)
    assert a == random_prompts(3, 20, 49152, seed=5) != random_prompts(3, 20, 49152, seed=6)
    assert all(len(p) == 20 and min(p) >= 100 for p in a)
