"""DeepSeek-V3 style: multi-head latent attention (models.latent_attention: a compressed KV cache
of kv_lora_rank + qk_rope_head_dim per token, queries through a low-rank projection, DeepSeek's
interleaved rotation with YaRN scaling), and mixture-of-experts MLPs after the first
`first_k_dense_replace` dense layers: sigmoid-scored, group-limited routing with a selection bias,
scaled weights, and shared experts (parallel/moe.py)."""

from __future__ import annotations

from typing import Any

from python_backends.config import ModelConfig
from python_backends.models.family import Family, llama_shape, refuse, rope_scaling, yarn_mscale


def config(hf: Any) -> ModelConfig:
    if getattr(hf, "attention_bias", False):
        raise refuse(hf, "attention_bias is not supported")
    theta, scaling = rope_scaling(hf)
    head = int(hf.qk_nope_head_dim) + int(hf.qk_rope_head_dim)
    scale = head**-0.5
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if scaling.rope_type != "default" and rope.get("mscale_all_dim"):
        # DeepSeek scales every query dimension, not only the rotated ones, by YaRN's mscale.
        scale *= yarn_mscale(scaling.factor, rope["mscale_all_dim"]) ** 2
    return llama_shape(
        hf, rope_theta=theta, rope_scaling=scaling, head_dim=head,
        rotary_dim=int(hf.qk_rope_head_dim), attention_scale=scale,
        kv_lora_rank=int(hf.kv_lora_rank), q_lora_rank=int(hf.q_lora_rank or 0),
        v_head_dim=int(hf.v_head_dim), rope_interleave=bool(getattr(hf, "rope_interleave", True)),
        num_experts=int(hf.n_routed_experts), num_experts_per_tok=int(hf.num_experts_per_tok),
        norm_topk_prob=bool(hf.norm_topk_prob), router_scoring="sigmoid",
        n_group=int(hf.n_group or 1), topk_group=int(hf.topk_group or 1),
        routed_scaling_factor=float(hf.routed_scaling_factor),
        n_shared_experts=int(hf.n_shared_experts or 0),
        first_dense_layers=int(hf.first_k_dense_replace or 0),
        moe_intermediate_size=int(hf.moe_intermediate_size))


FAMILY = Family("DeepSeek-V3", ("deepseek_v3",), config)
