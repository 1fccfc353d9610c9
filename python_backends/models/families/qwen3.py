"""Qwen3: Llama's shape with an RMSNorm over each head of q and k before the rotation, and the
head size its config names (not hidden / heads)."""

from __future__ import annotations

from typing import Any

from python_backends.config import ModelConfig
from python_backends.models.families.qwen2 import no_layer_windows
from python_backends.models.family import Family, llama_shape, refuse


def checked(hf: Any) -> None:
    no_layer_windows(hf)
    if getattr(hf, "attention_bias", False):
        raise refuse(hf, "attention_bias (biases on q, k, v and o) is not supported")


def config(hf: Any) -> ModelConfig:
    checked(hf)
    return llama_shape(hf, qk_norm=True)


FAMILY = Family("Qwen3", ("qwen3",), config)
