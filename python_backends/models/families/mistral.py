"""Mistral: Llama's shape with sliding-window attention (each query sees its last
`sliding_window` keys, itself included), where the checkpoint sets one."""

from __future__ import annotations

from typing import Any

from python_backends.config import ModelConfig
from python_backends.models.family import Family, llama_shape


def window(hf: Any) -> int:
    """The checkpoint's attention window in tokens; 0 where it has none or one no shorter than
    the longest sequence (which then limits nothing)."""
    w = getattr(hf, "sliding_window", None)
    return 0 if w is None or w >= hf.max_position_embeddings else int(w)


def config(hf: Any) -> ModelConfig:
    return llama_shape(hf, sliding_window=window(hf))


FAMILY = Family("Mistral", ("mistral",), config)
