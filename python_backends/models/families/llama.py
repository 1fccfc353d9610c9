"""Llama 2 / 3.x (llama3 rope scaling, tied or untied embeddings), SmolLM2: the shared decoder
as it is."""

from __future__ import annotations

from typing import Any

from python_backends.config import ModelConfig
from python_backends.models.family import Family, llama_shape, no_sliding_window, refuse


def config(hf: Any) -> ModelConfig:
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise refuse(hf, "attention or MLP biases are not supported")
    no_sliding_window(hf)
    return llama_shape(hf)


FAMILY = Family("Llama", ("llama",), config)
