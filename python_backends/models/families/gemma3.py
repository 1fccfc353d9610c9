"""Gemma 3 (text): Gemma 2's layer without the attention cap, with per-head q/k norms, and its
windowed layers rotating on their own base (`rope_parameters["sliding_attention"]`), five of
them to each full-attention layer."""

from __future__ import annotations

from typing import Any

from python_backends.config import ModelConfig
from python_backends.models.families.gemma2 import engine_state, gemma_switches
from python_backends.models.family import Family, llama_shape, refuse, rope_scaling


def config(hf: Any) -> ModelConfig:
    if getattr(hf, "use_bidirectional_attention", False):
        raise refuse(hf, "bidirectional attention (an embedding model) is not supported")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if "full_attention" in rope:
        theta, scaling = rope_scaling(hf, rope["full_attention"])
        local_theta, local_scaling = rope_scaling(hf, rope.get("sliding_attention") or {})
    else:  # one rotation for both (older configs: rope_theta and rope_local_base_freq)
        theta, scaling = rope_scaling(hf)
        local_theta = float(getattr(hf, "rope_local_base_freq", theta))
        local_scaling = type(scaling)()
    if local_scaling.rope_type != "default":
        raise refuse(hf, f"{local_scaling.rope_type} scaling on the sliding-window layers' "
                         "rotation is not supported")
    return llama_shape(hf, rope_theta=theta, rope_scaling=scaling, qk_norm=True,
                       local_rope_theta=local_theta, **gemma_switches(hf))


FAMILY = Family("Gemma 3", ("gemma3_text",), config, engine_state)
