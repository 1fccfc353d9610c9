"""Every model family (models/registry.py) equals Hugging Face's greedy output token for token on
a small random-weight checkpoint built here from transformers' config class: through the engine
with chunked prefill, prefix caching, preemption and speculative drafts, and split over ranks
(TP2 and PP2 for dense families, EP2 for mixture-of-experts ones).

Random norms and biases (transformers initializes them to ones and zeros; DeepSeek's expert
selection bias too) so that a family's norm or bias that the engine dropped or misplaced
changes the output."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from python_backends.config import EngineConfig, EngineConfigError, EngineLimits, ParallelLayout
from python_backends.engine.builder import model_config_from_hf, write_engine
from python_backends.engine.engine_loop import build_off_thread
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.speculative import SpeculationConfig
from python_backends.kv_store.host_store import STORE_PREFIX, HostKVStore
from python_backends.models import registry
from python_backends.parallel.layers import int8_supported, packable
from python_backends.params import SamplingParams
from tests.conftest import TinyModel
from tests.engine.test_llm_engine import run_all
from tests.engine.test_prefix_cache import with_store
from tests.engine.test_speculative import events_until_done, with_oracle
from tests.parallel.test_heterogeneous_handoff import N as HANDOFF_TOKENS
from tests.parallel.test_heterogeneous_handoff import hand_over

VOCAB = 250
WINDOW = 16  # the sliding-window families' window: shorter than the long prompt
# Small blocks and a small step budget: a 40-token prompt spans 10 blocks and is computed in
# chunks of at most 24 tokens.
LIMITS = EngineLimits(max_seq_len=128, max_num_seqs=8, max_num_batched_tokens=24, block_size=4)
SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    initializer_range=0.3, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
    eos_token_id=None)  # no end token: every run computes its 32 tokens, as HF's reference does
LONG_ROPE: dict[str, Any] = dict(
    rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=256,
    short_factor=[1.0 + 0.2 * i for i in range(6)], long_factor=[2.0 + 0.5 * i for i in range(6)])


YARN: dict[str, Any] = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                           original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=1.0,
                           beta_fast=32, beta_slow=1)
# Config fields transformers' config classes take without declaring them.
HEAD_16: dict[str, Any] = dict(head_dim=16)  # Qwen3's head size, not hidden / heads
PARTIAL: dict[str, Any] = dict(partial_rotary_factor=0.75)


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as t

    return {
        "llama": lambda: t.LlamaConfig(**SHAPE),
        "mistral": lambda: t.MistralConfig(**SHAPE, sliding_window=WINDOW),
        "mixtral": lambda: t.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=WINDOW),
        "qwen2": lambda: t.Qwen2Config(**SHAPE),
        "qwen3": lambda: t.Qwen3Config(**SHAPE, **HEAD_16),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**SHAPE, **HEAD_16, num_experts=8,
                                              num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True),
        "qwen3_moe-unnormalized": lambda: t.Qwen3MoeConfig(
            **SHAPE, **HEAD_16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=False),
        # Phi-4-mini's shape in small: 3/4 of each head rotated, LongRoPE (sequences here stay
        # within its pretraining length, where its short factors apply).
        "phi3": lambda: t.Phi3Config(**SHAPE, **PARTIAL, original_max_position_embeddings=256,
                                     rope_parameters=dict(LONG_ROPE, partial_rotary_factor=0.75)),
        # Scores and logits large enough here for Gemma 2's caps (50, 30) to change them.
        "gemma2": lambda: t.Gemma2Config(**SHAPE, head_dim=16, query_pre_attn_scalar=32,
                                         sliding_window=WINDOW),
        "gemma3": lambda: t.Gemma3TextConfig(
            **SHAPE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0,
                                                    rope_theta=100000.0),
                             "sliding_attention": dict(rope_type="default", rope_theta=500.0)}),
        # DeepSeek-V3's shape in small: latent attention with low-rank queries, YaRN, one dense
        # layer then experts in 4 groups (2 kept), a shared expert.
        "deepseek_v3": lambda: t.DeepseekV3Config(
            **{**SHAPE, "num_key_value_heads": 4}, moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=12, rope_parameters=YARN),
    }


FAMILIES = list(_configs())
MOE = {"mixtral", "qwen3_moe", "qwen3_moe-unnormalized", "deepseek_v3"}


def make_family(name: str, out_dir: Path, parallel: ParallelLayout | None = None,
                seed: int = 5, dtype: str = "float32", weights: str = "") -> TinyModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(_configs()[name]()).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
        for bname, b in hf.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # DeepSeek's selection bias
                b.copy_(0.3 * torch.randn_like(b))
    write_engine(hf, None, out_dir, LIMITS, dtype, "random", log=lambda _m: None,
                 parallel=parallel, weights=weights)
    return TinyModel(out_dir, hf)


def batch() -> list[list[int]]:
    """Four short prompts and one of 40 tokens (10 blocks, over twice the window)."""
    g = torch.Generator().manual_seed(7)
    lengths = [5, 9, 13, 17, 40]
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


N_TOKENS = 32


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, TinyModel, list[list[int]]]:
    name = request.param
    model = make_family(name, tmp_path_factory.mktemp(name) / "engine")
    want = [model.greedy(p, N_TOKENS) for p in batch()]
    return name, model, want


def test_engine_matches_hf_with_chunks_and_a_prefix_cache(
        family: tuple[str, TinyModel, list[list[int]]]) -> None:
    """Twice through one engine: the second time every prompt's full blocks come from the
    prefix cache."""
    _name, model, want = family
    engine = model.engine()
    try:
        assert run_all(engine, batch(), N_TOKENS) == want
        hits = engine.stats().prefix_cache_hits
        assert run_all(engine, batch(), N_TOKENS) == want
        assert engine.stats().prefix_cache_hits > hits
    finally:
        engine.close()


def test_log_probabilities_equal_hf(family: tuple[str, TinyModel, list[list[int]]]) -> None:
    """The chosen tokens' log-probabilities, from the engine's logits (after Gemma 2's final
    cap, which leaves the greedy choice as it is but not the probabilities)."""
    _name, model, want = family
    prompt, n = batch()[3], 8
    engine = model.engine()
    try:
        seq = engine.add_request("p", prompt, SamplingParams(max_tokens=n, return_log_probs=True))
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.close()
    assert seq.output_ids == want[3][:n]
    with torch.no_grad():
        logits = model.hf(torch.tensor([prompt + seq.output_ids])).logits[0].float()
    rows = logits[len(prompt) - 1: len(prompt) - 1 + n].log_softmax(-1)
    hf_logprobs = rows.gather(1, torch.tensor(seq.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(seq.output_logprobs), hf_logprobs, atol=2e-4,
                               rtol=1e-4)


def test_kv_handed_from_a_prefill_engine_to_a_decode_engine(
        family: tuple[str, TinyModel, list[list[int]]]) -> None:
    """Disaggregated: one engine computes the prompts, another decodes from their KV (a plain
    copy between the pools here; the transports are tests/kv_transfer's, the whole path through
    the server tests/e2e/test_families.py's)."""
    _name, model, want = family
    prefill, decode = model.engine(), model.engine()
    try:
        got = hand_over(prefill, decode, batch())
        assert got == [w[:HANDOFF_TOKENS] for w in want]
        assert prefill.blocks.num_used == 0 and decode.blocks.num_used == 0
    finally:
        prefill.close()
        decode.close()


def test_a_prefix_one_engine_computed_is_read_from_the_kv_store_by_another(
        family: tuple[str, TinyModel, list[list[int]]]) -> None:
    _name, model, want = family
    probe = model.engine(num_kv_blocks=4)
    layout = dataclasses.replace(probe.handoff.layout, num_blocks=64)
    probe.close()
    store = HostKVStore.create(f"{STORE_PREFIX}families_{uuid.uuid4().hex[:8]}", layout)
    tier = with_store(store.name)
    a, b = model.engine(kv_tier=tier), model.engine(kv_tier=tier)
    try:
        prompt = batch()[4]  # 10 full blocks: 9 can come from the store, the last is computed
        assert run_all(a, [prompt], N_TOKENS) == [want[4]]
        assert run_all(b, [prompt], N_TOKENS) == [want[4]]
        assert b.stats().kv_store_hits == 9 and b.stats().num_prompt_tokens_computed == 4
    finally:
        a.close()
        b.close()
        store.close()


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_the_16_bit_and_int8_forms_build_and_stay_close(
        tmp_path: Path, family: tuple[str, TinyModel, list[list[int]]], weights: str) -> None:
    """Not token-equal (they round differently; docs/engines.md, "Data types"): each prompt's
    first token is among HF's five likeliest in float32, most prompts' is HF's own."""
    name, reference, want = family
    if weights == "bfloat16" and not packable(torch.bfloat16):
        pytest.skip("this CPU has no bfloat16 instructions (the builder refuses it)")
    if weights == "int8" and (why := int8_supported()):
        pytest.skip(why)
    model = (make_family(name, tmp_path / "e", dtype="bfloat16") if weights == "bfloat16"
             else make_family(name, tmp_path / "e", weights="int8"))
    engine = model.engine()
    try:
        got = run_all(engine, batch(), 4)
    finally:
        engine.close()
    with torch.no_grad():
        likeliest = [set(reference.hf(torch.tensor([p])).logits[0, -1].topk(5).indices.tolist())
                     for p in batch()]
    assert all(g[0] in top for g, top in zip(got, likeliest, strict=True)), (got, likeliest)
    assert sum(g[0] == w[0] for g, w in zip(got, want, strict=True)) >= 2, (got, want)


def test_preempted_sequences_resume_equal_to_hf(
        family: tuple[str, TinyModel, list[list[int]]]) -> None:
    """A pool too small for the batch: sequences are preempted and recomputed."""
    _name, model, want = family
    engine = model.engine(num_kv_blocks=24, enable_prefix_caching=False)
    try:
        assert run_all(engine, batch(), N_TOKENS) == want
        assert engine.stats().num_preemptions > 0
    finally:
        engine.close()


def test_speculative_drafts_keep_hf_output(
        family: tuple[str, TinyModel, list[list[int]]]) -> None:
    """Drafts (right ones and a wrong one per sequence) checked in one step each."""
    _name, model, want = family
    engine = model.engine(speculation=SpeculationConfig(4))
    try:
        for i, p in enumerate(batch()):
            with_oracle(engine, str(i), p, SamplingParams(max_tokens=N_TOKENS), want[i],
                        wrong=i + 1)
        got: dict[str, list[int]] = {str(i): [] for i in range(len(want))}
        for ev in events_until_done(engine)[0]:
            got[ev.seq_id].append(ev.token_id)
        assert [got[str(i)] for i in range(len(want))] == want
        assert engine.stats().draft_tokens_accepted > 0
    finally:
        engine.close()


def layouts(name: str) -> list[ParallelLayout]:
    return [ParallelLayout(ep=2)] if name in MOE else [ParallelLayout(tp=2),
                                                       ParallelLayout(pp=2)]


@pytest.mark.parametrize("name", FAMILIES)
def test_split_over_ranks_matches_hf(tmp_path: Path, name: str) -> None:
    """TP2 and PP2 (EP2 for mixture-of-experts families): real gloo ranks, one process each."""
    for i, layout in enumerate(layouts(name)):
        model = make_family(name, tmp_path / f"e{i}", parallel=layout)
        engine = build_off_thread(partial(model.engine))
        try:
            assert run_all(engine, batch(), 12) == [model.greedy(p, 12) for p in batch()]
        finally:
            engine.close()


def test_every_family_is_registered_by_model_type() -> None:
    types = {c().model_type for c in _configs().values()}
    assert types <= set(registry.SUPPORTED_MODEL_TYPES)
    assert {f.name for f in registry.FAMILIES} >= {"Llama", "Qwen2 / Qwen2.5", "Qwen3",
                                                   "Qwen3-MoE", "Mistral", "Mixtral",
                                                   "Phi-3 / Phi-4-mini", "Gemma 2", "Gemma 3",
                                                   "DeepSeek-V3"}


def test_an_unsupported_model_type_is_refused_naming_the_supported(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(EngineConfigError, match=r"model_type 'gpt2' is not supported "
                                                r"\(supported: .*llama.*qwen3_moe"):
        write_engine(hf, None, tmp_path / "e", LIMITS, "float32", "x", log=lambda _m: None)
    assert not (tmp_path / "e").exists()


def test_what_a_family_does_not_compute_is_refused_by_name() -> None:
    import transformers as t

    with pytest.raises(EngineConfigError, match="qwen2 checkpoint: use_sliding_window"):
        model_config_from_hf(t.Qwen2Config(**SHAPE, use_sliding_window=True))
    with pytest.raises(EngineConfigError, match="qwen3_moe checkpoint: dense MLP layers"):
        model_config_from_hf(t.Qwen3MoeConfig(**SHAPE, mlp_only_layers=[1]))
    with pytest.raises(EngineConfigError, match="llama checkpoint: attention or MLP biases"):
        model_config_from_hf(t.LlamaConfig(**SHAPE, attention_bias=True))
    with pytest.raises(EngineConfigError, match="llama checkpoint: activation 'gelu'"):
        model_config_from_hf(t.LlamaConfig(**SHAPE, hidden_act="gelu"))


def test_an_engine_of_an_unknown_family_is_refused_at_load(tmp_path: Path) -> None:
    import dataclasses
    import json

    model = make_family("llama", tmp_path / "e")
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    config["architecture"] = "gpt2"
    (tmp_path / "e" / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineConfigError, match="model_type 'gpt2' is not supported"):
        LLMEngine.from_engine_dir(model.engine_dir, num_kv_blocks=8)
    assert dataclasses.is_dataclass(EngineConfig.load(tmp_path / "e"))


def test_family_configs_carry_what_makes_them_differ() -> None:
    cfgs = {name: model_config_from_hf(make()) for name, make in _configs().items()}
    assert cfgs["qwen2"].qkv_bias and not cfgs["llama"].qkv_bias
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 16
    assert cfgs["mistral"].sliding_window == WINDOW and cfgs["llama"].sliding_window == 0
    assert cfgs["qwen3_moe"].intermediate_size == 32 and cfgs["qwen3_moe"].num_experts == 8
    assert not cfgs["qwen3_moe-unnormalized"].norm_topk_prob and cfgs["mixtral"].norm_topk_prob
    phi = cfgs["phi3"]
    assert phi.rotary_dim == 12 and phi.rope_scaling.rope_type == "longrope"
    assert phi.rope_scaling.short_factor[:2] == (1.0, 1.2)
    assert phi.rope_scaling.attention_factor == pytest.approx(
        (1 + torch.log(torch.tensor(2.0)).item() / torch.log(torch.tensor(256.0)).item()) ** 0.5)


@pytest.mark.parametrize("name", ["mistral", "mixtral"])
def test_a_windowed_sequence_holds_only_its_windows_blocks(tmp_path: Path, name: str) -> None:
    """A sequence 4x the window long: the blocks behind every later query's window are
    released as it runs (the pool's count reads it), and the output stays HF's."""
    model = make_family(name, tmp_path / "e")
    block_size = LIMITS.block_size
    # The window's keys span at most WINDOW / block_size + 1 blocks; one more is being filled.
    bound = WINDOW // block_size + 2
    prompt = batch()[4]  # 40 tokens, computed in chunks of up to 24
    n = 4 * WINDOW - len(prompt)
    engine = model.engine()
    try:
        seq = engine.add_request("long", prompt, SamplingParams(max_tokens=n))
        most, used = 0, []
        while engine.has_unfinished:
            engine.step()
            used.append(engine.blocks.num_used)
            if not seq.is_finished:
                most = max(most, len(seq.held_blocks()))
        assert seq.output_ids == model.greedy(prompt, n)
        assert 0 < most <= bound, used
        assert max(used) <= bound + LIMITS.max_num_batched_tokens // block_size
        assert used[-1] == 0  # the finished sequence released the rest
    finally:
        engine.close()


def test_latent_attention_caches_one_latent_vector_per_token(tmp_path: Path) -> None:
    """DeepSeek's KV pool follows the latent cache: one plane of one (kv_lora_rank + rotated)
    vector per token and layer, 40 numbers here where K and V of its 4 heads would be 192."""
    from python_backends.engine.loader import kv_layout

    model = make_family("deepseek_v3", tmp_path / "e")
    config = EngineConfig.load(model.engine_dir)
    layout = kv_layout(config, num_kv_blocks=8, whole=True)
    assert (layout.planes, layout.num_kv_heads, layout.head_dim) == (1, 1, 32 + 8)
    assert layout.bytes_for(1) == 3 * LIMITS.block_size * 40 * 4
    engine = model.engine(num_kv_blocks=8)
    try:
        assert tuple(engine.runner.kv_pool.shape) == (3, 1, 8 * LIMITS.block_size, 1, 40)
    finally:
        engine.close()
    with pytest.raises(EngineConfigError, match="tp=2: latent attention caches one vector"):
        make_family("deepseek_v3", tmp_path / "tp2", parallel=ParallelLayout(tp=2))
