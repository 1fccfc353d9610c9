"""Qwen3-MoE: Qwen3's attention with mixture-of-experts MLPs in every layer (softmax router,
top-k, the chosen weights renormalized where `norm_topk_prob`), experts placed across
expert-parallel ranks (parallel/moe.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from python_backends.config import ModelConfig
from python_backends.models.families.qwen3 import checked
from python_backends.models.family import Family, llama_shape, refuse


def config(hf: Any) -> ModelConfig:
    checked(hf)
    if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
        raise refuse(hf, "dense MLP layers among the expert ones (mlp_only_layers, "
                         "decoder_sparse_step) are not supported")
    cfg = llama_shape(hf, qk_norm=True, num_experts=int(hf.num_experts),
                      num_experts_per_tok=int(hf.num_experts_per_tok),
                      norm_topk_prob=bool(hf.norm_topk_prob))
    # An expert's width; the checkpoint's intermediate_size is that of dense layers it has none of.
    return dataclasses.replace(cfg, intermediate_size=int(hf.moe_intermediate_size))


FAMILY = Family("Qwen3-MoE", ("qwen3_moe",), config)
