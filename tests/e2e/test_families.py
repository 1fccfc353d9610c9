"""Families other than the default model's, served by the running Triton server: a Qwen2.5, a
Gemma 3 and a DeepSeek-V3-style random-weight checkpoint (SmolLM2's vocabulary and tokenizer,
which the ensemble's preprocessing uses for every model) loaded into the worker group
(aggregated) and into the prefill and decode groups (disaggregated, the KV handed over: the
latent cache for DeepSeek), equal to Hugging Face's greedy output token for token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from python_backends.bench.client import as_list
from python_backends.config import EngineConfig
from python_backends.engine.builder import write_engine
from python_backends.metrics_text import metric_sum
from tests.e2e.conftest import ENGINE_DIR, PROMPTS, Reference, Server
from tests.e2e.test_parallel import serving

pytestmark = pytest.mark.e2e
N_TOKENS = 16


def random_checkpoint(family: str, out: Path) -> Any:
    import transformers as t

    torch.manual_seed(37)
    shape: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.3, tie_word_embeddings=True, eos_token_id=None)
    if family == "qwen2.5":
        cfg: Any = t.Qwen2Config(**shape)  # head size 64 / 4
    elif family == "deepseek":  # latent attention (the latent cache handed over), experts
        cfg = t.DeepseekV3Config(**{**shape, "num_key_value_heads": 4},
                                 moe_intermediate_size=32, n_routed_experts=8,
                                 num_experts_per_tok=2, n_group=4, topk_group=2,
                                 n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
                                 q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                 v_head_dim=12)
    else:  # a window shorter than the prompts, on two of the three layers
        cfg = t.Gemma3TextConfig(**shape, head_dim=16, query_pre_attn_scalar=16,
                                 sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention",
                                              "sliding_attention"])
    hf = t.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.3 * torch.randn_like(b))
    limits = EngineConfig.load(ENGINE_DIR).limits
    write_engine(hf, t.AutoTokenizer.from_pretrained(str(ENGINE_DIR)), out, limits, "float32",
                 "random", log=lambda _m: None)
    return hf


@pytest.mark.parametrize("family", ["qwen2.5", "gemma3", "deepseek"])
def test_a_family_is_served_aggregated_and_disaggregated_equal_to_hf(
        server: Server, reference: Reference, tmp_path: Path, family: str) -> None:
    engine = tmp_path / "engine"
    hf = random_checkpoint(family, engine)
    want = {}
    for prompt in PROMPTS[:4]:
        ids = reference.tokenizer(prompt)["input_ids"]
        want[prompt] = hf.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS,
                                   min_new_tokens=N_TOKENS, do_sample=False,
                                   pad_token_id=0)[0, len(ids):].tolist()
    with serving(server, {"worker": engine, "prefill": engine, "decode": engine}):
        before = server.metrics()
        for prompt in PROMPTS[:4]:
            for route in ("aggregated", "disaggregated"):
                out = server.client.generate(prompt, max_tokens=N_TOKENS, end_id=-1,
                                             route=route)
                assert as_list(out["output_ids"]) == want[prompt], (route, prompt)
        streamed = server.client.stream_collect(PROMPTS[1], max_tokens=N_TOKENS, end_id=-1,
                                                route="disaggregated")
        assert streamed.output_ids == want[PROMPTS[1]]
        after = server.metrics()
        # The decode group computed no prompt: each came from the prefill group's KV.
        computed = "llm_prompt_tokens_computed_total"
        assert metric_sum(after, computed, model="decode") == metric_sum(before, computed,
                                                                         model="decode")
        assert metric_sum(after, computed, model="prefill") > metric_sum(before, computed,
                                                                         model="prefill")
