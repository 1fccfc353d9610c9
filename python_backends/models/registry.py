"""The model families an engine can be built from, by their checkpoints' `model_type`.

A family is one module in `families/` (see models.family); adding one is writing that module
and listing it here. The builder, the loader and the engine ask this registry and know nothing
of any family.
"""

from __future__ import annotations

from typing import Any

from python_backends.config import EngineConfigError, ModelConfig
from python_backends.models.families import (
    deepseek_v3,
    gemma2,
    gemma3,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from python_backends.models.family import Family

FAMILIES: tuple[Family, ...] = tuple(
    m.FAMILY for m in (llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, phi3, gemma2, gemma3,
                       deepseek_v3))
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
SUPPORTED_MODEL_TYPES = tuple(sorted(_BY_TYPE))


def family(model_type: str) -> Family:
    """The family serving `model_type`; refused naming the supported ones."""
    try:
        return _BY_TYPE[model_type]
    except KeyError:
        raise EngineConfigError(
            f"model_type {model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})") from None


def model_config(hf: Any) -> ModelConfig:
    """A Hugging Face config's `ModelConfig`, by its family."""
    return family(hf.model_type).config(hf)
