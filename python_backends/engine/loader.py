"""Load an engine directory's weights into a model; no conversion happens here."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from python_backends.config import EngineConfig, EngineConfigError
from python_backends.models.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(engine_dir: str | Path, config: EngineConfig, rank: int = 0) -> LlamaForCausalLM:
    path = Path(engine_dir) / config.weight_files()[rank]
    if not path.is_file():
        raise EngineConfigError(f"weight file {path} missing: rebuild the engine")
    dtype = DTYPES[config.dtype]
    with torch.device("meta"):
        model = LlamaForCausalLM(config.model)
    state = load_file(str(path))
    expected = {k for k in model.state_dict() if not _is_tied_head(k, config)}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise EngineConfigError(
            f"{path}: missing tensors {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if config.model.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The rotary tables are buffers computed from the config, not weights: rebuild them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(
        config.model.head_dim, config.model.max_position_embeddings,
        config.model.rope_theta, config.model.rope_scaling,
    )
    return model.to(dtype).eval()


def _is_tied_head(name: str, config: EngineConfig) -> bool:
    return config.model.tie_word_embeddings and name == "lm_head.weight"
