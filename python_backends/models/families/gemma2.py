"""Gemma 2: GeGLU MLPs, norms before and after both attention and the MLP, each RMSNorm scaling
by (1 + weight), embeddings scaled by sqrt(hidden_size), queries by query_pre_attn_scalar, capped
attention scores and logits (s -> cap * tanh(s / cap)), and sliding-window layers alternating
with full-attention ones."""

from __future__ import annotations

from typing import Any

from python_backends.config import ModelConfig
from python_backends.models.family import Family, State, llama_shape, refuse


def gemma_switches(hf: Any) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share."""
    if getattr(hf, "attention_bias", False):
        raise refuse(hf, "attention_bias is not supported")
    types = list(getattr(hf, "layer_types", None) or [])
    if len(types) != hf.num_hidden_layers:
        raise refuse(hf, f"layer_types names {len(types)} layers, the model has "
                         f"{hf.num_hidden_layers}")
    return dict(
        hidden_act=str(hf.hidden_activation),
        sandwich_norms=True,
        embedding_multiplier=float(hf.hidden_size) ** 0.5,
        attention_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        sliding_window=int(hf.sliding_window or 0),
        global_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        final_logit_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
    )


def config(hf: Any) -> ModelConfig:
    softcap = float(getattr(hf, "attn_logit_softcapping", None) or 0.0)
    return llama_shape(hf, attn_logit_softcap=softcap, **gemma_switches(hf))


def engine_state(cfg: ModelConfig, state: State) -> State:
    """Gemma's RMSNorms scale by (1 + weight): the engine's norms by weight, so the 1 is added
    here, once (in float32, as Gemma adds it)."""
    return {name: (t.float() + 1.0 if name.endswith("norm.weight") else t)
            for name, t in state.items()}


FAMILY = Family("Gemma 2", ("gemma2",), config, engine_state)
