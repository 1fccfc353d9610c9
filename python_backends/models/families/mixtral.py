"""Mixtral: Mistral with mixture-of-experts MLPs (softmax router, top-k, the chosen weights
renormalized), experts placed across expert-parallel ranks (parallel/moe.py)."""

from __future__ import annotations

from typing import Any

from python_backends.config import ModelConfig
from python_backends.models.families.mistral import window
from python_backends.models.family import Family, llama_shape


def config(hf: Any) -> ModelConfig:
    return llama_shape(hf, sliding_window=window(hf), num_experts=int(hf.num_local_experts),
                       num_experts_per_tok=int(hf.num_experts_per_tok), norm_topk_prob=True)


FAMILY = Family("Mixtral", ("mixtral",), config)
