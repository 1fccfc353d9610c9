"""Load an engine directory's weights into a model; no conversion happens here."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from python_backends.config import SUPPORTED_DTYPES, EngineConfig, EngineConfigError
from python_backends.host_memory import trim_heap
from python_backends.kv_transfer.layout import KVLayout
from python_backends.models import registry
from python_backends.models.decoder import CausalLM
from python_backends.parallel.context import ParallelContext

DTYPES = {name: getattr(torch, name) for name in SUPPORTED_DTYPES}
# Engine files keep Hugging Face's names; the model packs these projections into one matrix
# each (fewer, larger GEMMs: on a CPU every kernel launch is a thread-pool wake-up).
PACKED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def pack_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> model names, concatenating packed projections along dim 0."""
    out = dict(state)
    for packed, parts in PACKED_MODULES.items():
        for name in [k for k in state if f".{parts[0]}." in k]:
            names = [name.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            if all(n in out for n in names):
                out[name.replace(f".{parts[0]}.", f".{packed}.")] = torch.cat(
                    [out.pop(n) for n in names]
                )
    return out


def load_model(
    engine_dir: str | Path, config: EngineConfig, ctx: ParallelContext | None = None
) -> CausalLM:
    """The weights of rank `ctx.rank` (default: the single-rank context), on `ctx.device`."""
    ctx = ctx or ParallelContext(config.parallel)
    path = Path(engine_dir) / config.weight_files()[ctx.rank]
    if not path.is_file():
        raise EngineConfigError(f"weight file {path} missing: rebuild the engine")
    dtype = DTYPES[config.dtype]
    registry.family(config.architecture)  # refuses an engine of a family this code lacks
    with torch.device("meta"):
        model = CausalLM(config.model, ctx)
    state = pack_weights(load_file(str(path), device=str(ctx.device)))
    tied = config.model.tie_word_embeddings and model.model.embed_tokens is not None
    expected = {k for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise EngineConfigError(
            f"{path}: missing tensors {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if tied and model.lm_head is not None and model.model.embed_tokens is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The rotary tables are buffers computed from the config, not weights: rebuild them for real.
    model.model.reset_rotary(config.model)
    model = model.to(device=ctx.device, dtype=dtype).eval()
    if config.weights == "int8":
        if ctx.device.type != "cpu":
            raise EngineConfigError("int8 weights compute on the CPU only (fbgemm); build a "
                                    "GPU engine without --weights int8")
        model.quantize_linears()
    else:
        model.pack_linears()
    trim_heap()
    return model

def kv_layout(config: EngineConfig, num_kv_blocks: int, rank: int = 0,
              whole: bool = False) -> KVLayout:
    """The KV pool of rank `rank`: its stage's layers and its tensor-parallel share of heads;
    `whole`: every layer and head (what KV transports move, whatever the layout)."""
    ctx = ParallelContext() if whole else ParallelContext(config.parallel, rank)
    m = config.model
    planes, heads, head_dim = m.kv_cache_shape
    return KVLayout(
        num_layers=len(ctx.layout.stage_layers(m.num_layers, ctx.pp_rank)),
        num_kv_heads=heads // ctx.tp_size, head_dim=head_dim,
        block_size=config.limits.block_size, dtype=config.dtype, num_blocks=num_kv_blocks,
        tp_rank=ctx.tp_rank, tp_size=ctx.tp_size, planes=planes)
