"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Each token's keys and values are compressed into one vector all heads share: kv_lora_rank
dimensions (normalized) plus the rotated part of the key (R dimensions). The cache holds that
vector, one "head" in one plane per layer (ModelConfig.kv_cache_shape), so a block is
(kv_lora_rank + R) / (2 * K * D) of a Llama-shaped block of the same model, and KV transports move
it as they move any pool. Attention expands the context's latents into keys and values through
kv_b_proj each step (what Hugging Face computes; absorbing kv_b_proj into the query and the output
would read the latents directly and is the faster form for long contexts).

Shapes: T tokens in the step, H heads, Dk a query/key head (unrotated + R), Dv a value head,
C kv_lora_rank, L the longest context of a decode batch, B decoding sequences.
"""

from __future__ import annotations

import torch
from torch import nn

from python_backends.config import ModelConfig
from python_backends.models.attention import AttentionMetadata, sdpa
from python_backends.models.common import (
    RMSNorm,
    Rotary,
    apply_rotary,
    apply_rotary_interleaved,
)
from python_backends.parallel.context import ParallelContext
from python_backends.parallel.layers import Linear, RowParallelLinear

LOW_RANK_EPS = 1e-6  # the low-rank norms' (q_a_layernorm, kv_a_layernorm), as transformers'


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.num_heads = h = cfg.num_heads  # not split: ParallelLayout refuses tp > 1
        self.rope_dim = cfg.rotary_dim
        self.nope_dim = cfg.head_dim - cfg.rotary_dim
        self.v_dim = cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LOW_RANK_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.head_dim, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, h * cfg.head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, LOW_RANK_EPS)
        self.kv_b_proj = Linear(self.rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = RowParallelLinear(h * self.v_dim, cfg.hidden_size, ctx)
        self.scale = cfg.attention_scale or cfg.head_dim**-0.5
        self.rotate = apply_rotary_interleaved if cfg.rope_interleave else apply_rotary
        self.kv_cache = torch.empty(0)  # [1, S, 1, C + R]; bound by the model runner

    def forward(self, x: torch.Tensor, rotary: Rotary, meta: AttentionMetadata) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(t, h, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        compressed, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        k_rot = self.rotate(k_rot.reshape(t, 1, self.rope_dim), rotary).view(t, self.rope_dim)
        latent = torch.cat((self.kv_a_layernorm(compressed), k_rot), dim=-1)  # [T, C + R]
        self.kv_cache[0].index_copy_(0, meta.slot_mapping, latent.unsqueeze(1))
        q = torch.cat((q_nope, self.rotate(q_rot, rotary)), dim=-1)  # [T, H, Dk]
        out = q.new_empty(t, h, self.v_dim)
        for span in meta.prefills:
            n = span.end - span.start
            if span.mask is None:  # nothing cached before: this step's latents
                context = latent[span.start:span.end]
            else:
                context = self.kv_cache[0].index_select(0, span.context_slots)[:, 0]
            k, v = self._expand(context)  # [L, H, Dk], [L, H, Dv]
            o = sdpa(q[span.start:span.end].transpose(0, 1).unsqueeze(0),
                     k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                     span.mask, self.scale, causal=span.mask is None)
            out[span.start:span.end] = o[0].transpose(0, 1)[:n]
        if (d := meta.decode) is not None:
            b, longest = d.slots.shape
            context = self.kv_cache[0].index_select(0, d.slots.view(-1)).view(b, longest, -1)
            k, v = self._expand(context)  # [B, L, H, Dk], [B, L, H, Dv]
            o = sdpa(q[d.token_index].unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                     d.mask, self.scale)  # [B, H, 1, Dv]
            out[d.token_index] = o.squeeze(2)
        return self.o_proj(out.reshape(t, h * self.v_dim))

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [..., C + R] -> keys [..., H, Dk] and values [..., H, Dv]."""
        compressed, k_rot = latent.split([self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(compressed).view(*compressed.shape[:-1], self.num_heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rot = k_rot.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope_dim)
        return torch.cat((k_nope, k_rot), dim=-1), v
