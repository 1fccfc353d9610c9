"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-without-sliding-window) over a paged cache.

Parameter names follow Hugging Face's `LlamaForCausalLM`, so engine weight files are plain
state dicts. Numerics follow Hugging Face's float32 path (RMSNorm in float32, rotate-half RoPE)
because greedy output must match it token for token.

Shapes: T tokens in the step, E hidden size, H/K query/KV heads, D head size, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from python_backends.config import ModelConfig, RopeScaling
from python_backends.engine.attention import AttentionMetadata, paged_attention, write_kv


class Linear(nn.Linear):
    """nn.Linear that can pre-pack its weight for oneDNN on the CPU.

    A batch-16 decode step streams every weight once; oneDNN's blocked layout halves the time of
    those small-M GEMMs against the default sgemm path (measured here: 23 vs 50 ms for 424 MB of
    cold weights). Packing happens once after loading; results differ from F.linear only in
    float32 rounding (~1e-4), and greedy output is checked against Hugging Face in the tests.
    """

    packed: torch.Tensor | None = None

    def pack(self) -> bool:
        if self.weight.dtype != torch.float32 or self.weight.device.type != "cpu":
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)
        except (RuntimeError, AttributeError):  # no oneDNN in this build: keep F.linear
            return False
        # The plain copy is no longer read (a tied embedding keeps its own reference).
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel; in float32 it rounds exactly like Hugging Face's four-op version.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies [D/2], with the checkpoint's scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by position (rotate-half convention)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """The step's tables, looked up once and shared by every layer."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)  # [T, 1, D]
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, D]


def apply_rotary(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """x: [T, heads, D]."""
    cos, sin = rotary
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections packed into one matrix (see loader.PACKED_MODULES).
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        # [2, S, K, D]; bound by the model runner once the pool is allocated.
        self.kv_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, rotary: Rotary, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(t, self.num_heads, self.head_dim), rotary)  # [T, H, D]
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), rotary)  # [T, K, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        write_kv(self.kv_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, self.kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up projections packed into one matrix (see loader.PACKED_MODULES).
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rotary: Rotary, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, E]
        rotary = self.rotary_emb(meta.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rotary, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [N, V] (float32) of the tokens in `meta.logits_index`."""
        hidden = self.model(input_ids, meta)
        return self.lm_head(hidden[meta.logits_index]).float()

    def pack_linears(self) -> int:
        """Pre-pack every projection for oneDNN (CPU, float32); returns how many were packed."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]
