"""Split a full Hugging Face state dict into one rank's shards (run once, by the engine builder).

Names stay Hugging Face's, with layer indices renumbered from 0 within each pipeline stage;
the shapes are those of the parallel layers in python_backends/parallel/layers.py.
"""

from __future__ import annotations

import re

import torch

from python_backends.config import ModelConfig, ParallelLayout
from python_backends.parallel.context import ParallelContext
from python_backends.parallel.layers import padded_vocab

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Column-parallel weights split their rows (output features: whole heads, since the head size
# divides each slice), row-parallel ones their columns (input features); the experts of a
# mixture-of-experts layer ([experts, ...] tensors) are split whole across expert-parallel ranks.
_COLUMN = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
           "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
           "mlp.gate_proj.weight", "mlp.up_proj.weight"}
_ROW = {"self_attn.o_proj.weight", "mlp.down_proj.weight"}
_EXPERTS = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}


def _slice(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    size = t.shape[dim] // tp
    return t.narrow(dim, rank * size, size).contiguous()


def _vocab_shard(t: torch.Tensor, vocab: int, tp: int, rank: int) -> torch.Tensor:
    padded = padded_vocab(vocab, tp)
    if padded != t.shape[0]:
        t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
    return _slice(t, 0, tp, rank)


def shard_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig, layout: ParallelLayout, rank: int
) -> dict[str, torch.Tensor]:
    """The tensors rank `rank` holds. `state` is the full model's (tied head absent or present)."""
    ctx = ParallelContext(layout, rank)
    tp, tp_rank = layout.tp, ctx.tp_rank
    layers = layout.stage_layers(cfg.num_layers, ctx.pp_rank)
    first, last = ctx.is_first_stage, ctx.is_last_stage
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _LAYER.match(name)
        if m:
            index, rest = int(m.group(1)), m.group(2)
            if index not in layers:
                continue
            local = f"model.layers.{index - layers.start}.{rest}"
            if rest in _COLUMN:
                out[local] = _slice(t, 0, tp, tp_rank)
            elif rest in _ROW:
                out[local] = _slice(t, 1, tp, tp_rank)
            elif rest in _EXPERTS:
                out[local] = _slice(t, 0, layout.ep, ctx.ep_rank)
            else:
                out[local] = t.contiguous()  # norms (q/k's per head), the router: replicated
        elif name == "model.embed_tokens.weight":
            if first:
                out[name] = _vocab_shard(t, cfg.vocab_size, tp, tp_rank)
        elif name == "model.norm.weight":
            if last:
                out[name] = t.contiguous()
        elif name == "lm_head.weight":
            if last:
                out[name] = _vocab_shard(t, cfg.vocab_size, tp, tp_rank)
        else:
            raise ValueError(f"unexpected tensor {name!r}")
    # A tied head on a stage without the embedding needs its own copy of the table.
    if cfg.tie_word_embeddings and last and not first and "lm_head.weight" not in out:
        out["lm_head.weight"] = _vocab_shard(state["model.embed_tokens.weight"], cfg.vocab_size,
                                             tp, tp_rank)
    return out
