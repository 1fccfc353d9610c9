"""What a model family is to the engine: how its Hugging Face config becomes a `ModelConfig`
and how its checkpoint's tensors become the engine's names. One file per family under
`families/` declares one `Family`; `registry` finds it by the checkpoint's `model_type`.

The helpers here read the fields most families share (the Llama shape); a family's file reads
what is its own, and refuses what the shared decoder does not compute, saying what.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from python_backends.config import EngineConfigError, ModelConfig, RopeScaling

State = dict[str, torch.Tensor]


def same_names(cfg: ModelConfig, state: State) -> State:
    return state


@dataclass(frozen=True)
class Family:
    name: str  # as docs/engines.md's table names it
    model_types: tuple[str, ...]  # the Hugging Face config's `model_type` values it serves
    config: Callable[[Any], ModelConfig]  # a Hugging Face config -> the decoder's
    # A checkpoint's state dict -> the engine's tensor names (Hugging Face Llama's, which the
    # loader packs and the sharder splits): for families that fuse or rename projections.
    engine_state: Callable[[ModelConfig, State], State] = field(default=same_names)


def refuse(hf: Any, why: str) -> EngineConfigError:
    return EngineConfigError(f"{hf.model_type} checkpoint: {why}")


def rope_scaling(hf: Any, params: dict[str, Any] | None = None) -> tuple[float, RopeScaling]:
    """(theta, scaling) from either form transformers gives: `rope_parameters` (v5) or the
    older `rope_theta` and `rope_scaling`; `params`: one layer type's (Gemma 3's)."""
    rope = dict(params if params is not None else getattr(hf, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
    legacy = getattr(hf, "rope_scaling", None) or {}
    rope = {**legacy, **rope}
    rope_type = str(rope.get("rope_type") or rope.get("type") or "default")
    known = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    kwargs: dict[str, Any] = {k: rope[k] for k in known if rope.get(k) is not None}
    if rope_type == "longrope":
        original = int(rope.get("original_max_position_embeddings")
                       or getattr(hf, "original_max_position_embeddings", 0)
                       or hf.max_position_embeddings)
        # As transformers computes it when the checkpoint leaves it out.
        factor = rope.get("factor") or hf.max_position_embeddings / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = (1.0 if factor <= 1.0
                         else math.sqrt(1 + math.log(factor) / math.log(original)))
        kwargs.update(original_max_position_embeddings=original, factor=float(factor),
                      attention_factor=float(attention),
                      short_factor=tuple(float(f) for f in rope["short_factor"]),
                      long_factor=tuple(float(f) for f in rope["long_factor"]))
    if rope_type == "yarn":
        original = int(rope.get("original_max_position_embeddings")
                       or hf.max_position_embeddings)
        factor = float(rope.get("factor") or hf.max_position_embeddings / original)
        attention = rope.get("attention_factor")
        if attention is None:
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                         if mscale and mscale_all_dim else yarn_mscale(factor))
        kwargs.update(original_max_position_embeddings=original, factor=factor,
                      attention_factor=float(attention),
                      beta_fast=float(rope.get("beta_fast") or 32),
                      beta_slow=float(rope.get("beta_slow") or 1),
                      truncate=bool(rope.get("truncate", True)))
    return float(theta), RopeScaling(rope_type=rope_type, **kwargs)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times longer (0.1 m ln s + 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def head_dim(hf: Any) -> int:
    return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def rotary_dim(hf: Any) -> int:
    """Rotated dimensions per head where the checkpoint rotates only part of each (0: all)."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    factor = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if factor is None or float(factor) >= 1.0:
        return 0
    return int(head_dim(hf) * float(factor))


def check_silu(hf: Any) -> None:
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise refuse(hf, f"activation {act!r} is not supported (silu only)")


def llama_shape(hf: Any, **switches: Any) -> ModelConfig:
    """The fields every Llama-shaped family has, plus the family's `switches` (ModelConfig's
    other fields)."""
    if "hidden_act" not in switches:
        check_silu(hf)
    if "rope_theta" not in switches:
        switches["rope_theta"], switches["rope_scaling"] = rope_scaling(hf)
    fields: dict[str, Any] = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim(hf),
        rms_norm_eps=float(hf.rms_norm_eps),
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )
    return ModelConfig(**{**fields, **switches})


def no_sliding_window(hf: Any) -> None:
    """Refuse a window that limits attention, for families served without one."""
    window = getattr(hf, "sliding_window", None)
    use = getattr(hf, "use_sliding_window", True)
    if use and window is not None and window < hf.max_position_embeddings:
        raise refuse(hf, f"sliding-window attention ({window} tokens) is not supported for "
                         "this family")
