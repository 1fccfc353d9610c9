"""Phi-3 and Phi-4-mini: Llama's shape with q, k and v fused into one projection and gate and
up into another in the checkpoint (split at build time into the engine's names, which the
loader packs again), a partial rotation (Phi-4-mini turns 3/4 of each head), LongRoPE scaling,
and a sliding window where the checkpoint's is shorter than its context (Phi-3-mini-4k)."""

from __future__ import annotations

from typing import Any

import torch

from python_backends.config import ModelConfig
from python_backends.models.families.mistral import window
from python_backends.models.family import Family, State, llama_shape, rotary_dim

_FUSED = {".self_attn.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.",
                                   ".self_attn.v_proj."),
          ".mlp.gate_up_proj.": (".mlp.gate_proj.", ".mlp.up_proj.")}


def config(hf: Any) -> ModelConfig:
    return llama_shape(hf, rotary_dim=rotary_dim(hf), sliding_window=window(hf))


def engine_state(cfg: ModelConfig, state: State) -> State:
    """The fused projections split into the engine's (Hugging Face Llama's) names."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    sizes = {".self_attn.qkv_proj.": [q, kv, kv],
             ".mlp.gate_up_proj.": [cfg.intermediate_size, cfg.intermediate_size]}
    out: State = {}
    for name, t in state.items():
        fused = next((f for f in _FUSED if f in name), None)
        if fused is None:
            out[name] = t
            continue
        for part, piece in zip(_FUSED[fused], torch.split(t, sizes[fused]), strict=True):
            out[name.replace(fused, part)] = piece.contiguous()
    return out


FAMILY = Family("Phi-3 / Phi-4-mini", ("phi3",), config, engine_state)
