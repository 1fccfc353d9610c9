"""Qwen2 and Qwen2.5: Llama's shape with biases on the q, k and v projections (not on o)."""

from __future__ import annotations

from typing import Any

from python_backends.config import ModelConfig
from python_backends.models.family import Family, llama_shape, refuse


def no_layer_windows(hf: Any) -> None:
    """Qwen's checkpoints ship `sliding_window` with `use_sliding_window` off; on, it windows
    only the layers from `max_window_layers` up, which the decoder does not compute."""
    if getattr(hf, "use_sliding_window", False):
        raise refuse(hf, "use_sliding_window (windows on some layers only) is not supported")


def config(hf: Any) -> ModelConfig:
    no_layer_windows(hf)
    return llama_shape(hf, qkv_bias=True)


FAMILY = Family("Qwen2 / Qwen2.5", ("qwen2",), config)
