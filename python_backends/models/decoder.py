"""The decoder every family shares (python_backends/models/registry.py lists them): a
pre-norm transformer over a paged cache, whose differences between families are fields of
`ModelConfig` (biases on q/k/v, per-head q/k norms, partial and LongRoPE rotations, sliding-window
attention, mixture-of-experts MLPs), set by each family's file from its checkpoint's config.

Parameter names follow Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...), so engine
weight files are plain state dicts. Numerics follow Hugging Face's float32 path (RMSNorm in
float32, rotate-half RoPE) because greedy output must match it token for token.

Parallelism lives in the layers (python_backends/parallel/layers.py): under tensor parallelism
each rank holds H/tp query and K/tp KV heads (and their slice of the paged cache) and I/tp of the
MLP; under pipeline parallelism a stage holds a contiguous range of layers, the first stage the
embedding and the last the final norm and LM head. With one rank it is the plain model.

Shapes: T tokens in the step, E hidden size, H/K query/KV heads (this rank's), D head size,
R rotated dimensions of a head (D unless the rotation is partial), V vocabulary.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from python_backends import procfs
from python_backends.config import ModelConfig, RopeScaling
from python_backends.host_memory import huge_page_empty
from python_backends.models import kernels
from python_backends.models.attention import AttentionMetadata, paged_attention, write_kv
from python_backends.models.common import (
    RMSNorm,
    Rotary,
    RotaryEmbedding,
    apply_rotary,
)
from python_backends.models.greedy_head import FEW_ROWS, GreedyHead
from python_backends.models.latent_attention import LatentAttention
from python_backends.parallel.context import ParallelContext
from python_backends.parallel.layers import (
    ColumnParallelLinear,
    Linear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    best_in_turn,
    pass_seconds,
    plain_reads_faster,
    shard_size,
)
from python_backends.parallel.moe import MoE

log = logging.getLogger(__name__)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, index: int = 0) -> None:
        """`index`: the layer's, in the whole model (which layers are windowed)."""
        super().__init__()
        self.num_heads = shard_size(cfg.num_heads, ctx)
        self.num_kv_heads = shard_size(cfg.num_kv_heads, ctx)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # q, k and v projections packed into one matrix (see loader.PACKED_MODULES).
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, ctx,
            bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, ctx)
        # Qwen3: each head's query and key normalized before the rotation.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attention_scale or cfg.head_dim**-0.5
        self.softcap = cfg.attn_logit_softcap
        # Where only some layers are windowed (Gemma), these read the step's windowed view.
        self.windowed = cfg.is_windowed_layer(index)
        # [2, S, K, D]; bound by the model runner once the pool is allocated.
        self.kv_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, rotary: Rotary, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat((self.q_norm(q.reshape(-1, self.head_dim)).view(t, -1),
                             self.k_norm(k.reshape(-1, self.head_dim)).view(t, -1), v), dim=-1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        full_turn = rotary[0].shape[-1] == self.head_dim
        if ((ops := kernels.layer_ops(qkv)) is not None and full_turn
                and self.kv_cache.is_contiguous()):
            q, k = ops.rope_write_kv(qkv, *rotary, self.kv_cache, meta.slot_mapping,
                                     self.num_heads, self.num_kv_heads)
        else:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(q.view(t, self.num_heads, self.head_dim), rotary)  # [T, H, D]
            k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), rotary)  # [T, K, D]
            write_kv(self.kv_cache, k, v, meta.slot_mapping)
        if self.windowed and meta.windowed is not None:
            meta = meta.windowed
        o = paged_attention(q, k, v, self.kv_cache, meta, self.scale, self.softcap)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, width: int = 0) -> None:
        """`width`: the intermediate size (default: the config's)."""
        super().__init__()
        width = width or cfg.intermediate_size
        # gate and up projections packed into one matrix (see loader.PACKED_MODULES).
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * width, ctx)
        self.down_proj = RowParallelLinear(width, cfg.hidden_size, ctx)
        self.silu = cfg.hidden_act == "silu"  # SwiGLU; else GeGLU (tanh-approximated GELU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if not self.silu:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if (ops := kernels.layer_ops(gate_up)) is not None and gate_up.dim() == 2:
            return self.down_proj(ops.silu_mul(gate_up.contiguous()))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, index: int = 0) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn: Attention | LatentAttention = (
            LatentAttention(cfg, ctx) if cfg.kv_lora_rank else Attention(cfg, ctx, index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = (RMSNorm(cfg.hidden_size, eps) if cfg.sandwich_norms
                                          else None)
        self.post_feedforward_layernorm = (RMSNorm(cfg.hidden_size, eps) if cfg.sandwich_norms
                                           else None)
        self.mlp: MoE | MLP
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg, ctx)
            if cfg.n_shared_experts:  # DeepSeek: one MLP as wide as the shared experts
                self.mlp.shared_experts = MLP(
                    cfg, ctx, cfg.n_shared_experts * cfg.expert_intermediate_size)
        else:
            self.mlp = MLP(cfg, ctx)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rotary: Rotary,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; delta: what the layer before adds to it (None: nothing).
        Returns the same pair for the next layer: each residual add joins the norm after it."""
        x, h = self.input_layernorm.add_norm(x, delta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x, h = self.post_attention_layernorm.add_norm(x, self.self_attn(h, rotary, meta))
            return x, self.mlp(h)
        attended = self.post_attention_layernorm(self.self_attn(h, rotary, meta))
        x, h = self.pre_feedforward_layernorm.add_norm(x, attended)
        return x, self.post_feedforward_layernorm(self.mlp(h))


def rotary_embeddings(cfg: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The rotation of every layer, and a second one for windowed layers where they turn on
    another base (Gemma 3's local layers: `local_rope_theta`, unscaled)."""
    dims = cfg.rotary_dim or cfg.head_dim
    main = RotaryEmbedding(dims, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    if not cfg.local_rope_theta:
        return main, None
    return main, RotaryEmbedding(dims, cfg.max_position_embeddings, cfg.local_rope_theta,
                                 RopeScaling())


class NarrowerBudget:
    """What the projections' narrower forms (kernels.NativeLinear.blocks: kept beside the
    float32 panels, up to half their bytes again for a 16-bit checkpoint) may take: a quarter
    of the memory available at load, so that a model that fits in float32 still loads. Past it
    the rest read float32 only."""

    SHARE = 4  # a 1/SHARE of MemAvailable

    def __init__(self, available: int | None) -> None:
        self.available = available
        self.left = available // self.SHARE if available is not None else None
        self.refused = 0

    def blocks(self, find: Callable[[torch.Tensor], kernels.Narrow | None],
               weight: torch.Tensor) -> kernels.Narrow | None:
        if self.left is not None and self.left <= 0:
            self.refused += 1
            return None
        found = find(weight)
        if found is not None and self.left is not None:
            self.left -= found.packed.numel() * found.packed.element_size()
        return found


def _screened(head: GreedyHead | None) -> str:
    """How greedy rows' LM head runs, for the load log."""
    if head is None:
        return "in full"
    few = f", steps of at most {FEW_ROWS} rows on {head.few_rows.path}" if head.few_rows else ""
    return f"screened on {head.screen.path}{few} (models.greedy_head)"


def _narrower_form(linear: Linear) -> str:
    """What a projection's few-row steps read (kernels.NativeLinear.blocks), for the load log."""
    return "as " + {"": "float32", "q4": "4-bit GGUF blocks", "u8g32": "5-bit GGUF blocks",
                    "u8g16": "Q6_K blocks", "q8": "Q8_0 blocks", "bf16": "bfloat16",
                    "f16": "float16"}[linear.native_kind]


UNPACK_TIMING_ROWS = 32  # a decode step's rows at concurrency 32 with drafts, below AMX's
UNPACK_ALL = 1 << 30  # set_unpack_rows: every call past a tile's rows


def unpacked_reads_faster(linears: list[Linear], margin: float = 0.95,
                          rounds: int = 3) -> tuple[bool, float, float]:
    """Whether steps of more rows than a tile compute faster from the blocks, each panel unpacked
    once for every row tile (csrc/linear.cpp, unpacked_panels), than from the float32 panels:
    (at most `margin` of the time, the two best times in seconds). Which is faster depends on how
    fast a core reads memory against its arithmetic, not on its instruction set (docs/engines.md,
    "Weights read in an exact narrower form"), so it is measured: every projection with a
    narrower form once at UNPACK_TIMING_ROWS rows on the engine thread alone, the two ways in
    turn (layers.best_in_turn). AMX's levels are switched off meanwhile: where they compute
    those rows (set_amx_levels), neither way is read, and the choice is for the rest."""
    ops = torch.ops.llm_kernels

    def timed(rows: int) -> Callable[[], float]:
        def run() -> float:
            ops.set_unpack_rows(rows)
            return pass_seconds(linears, UNPACK_TIMING_ROWS, repeats=1)
        return run

    before, levels = ops.set_unpack_rows(0), ops.set_amx_levels(False)
    try:
        with kernels.helper_off():
            panels, unpacked = best_in_turn(timed(0), timed(UNPACK_ALL), rounds)
    finally:
        ops.set_unpack_rows(before)
        ops.set_amx_levels(levels)
    return unpacked <= margin * panels, unpacked, panels


class DecoderModel(nn.Module):
    """This stage's layers (numbered from 0 within the stage), with the embedding on the first
    stage and the final norm on the last. The rotary tables are computed, not loaded: the loader
    builds them again after loading on the meta device (`reset_rotary`)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
                             if ctx.is_first_stage else None)
        layers = ctx.layout.stage_layers(cfg.num_layers, ctx.pp_rank)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ctx, i) for i in layers)
        self.windowed = [cfg.is_windowed_layer(i) for i in layers]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if ctx.is_last_stage else None
        self.embedding_multiplier = cfg.embedding_multiplier
        self.rotary_emb, self.local_rotary_emb = rotary_embeddings(cfg)
        self._stack_attentions: list[Attention] = []  # whose caches native_stack reads

    def reset_rotary(self, cfg: ModelConfig) -> None:
        self.rotary_emb, self.local_rotary_emb = rotary_embeddings(cfg)

    # Every layer of a step in one native call (kernels.DecoderStack), where `build_native_stack`
    # found the layers its kind: the same kernels in the same order as the layers' own forward.
    native_stack: kernels.DecoderStack | None = None

    def build_native_stack(self) -> bool:
        """Run steps through kernels.DecoderStack from now on, where every layer is the kind it
        computes (Llama's: pre-norm attention over the whole head's rotation without a softcap,
        Qwen2's q/k/v bias and Qwen3's q/k norms included, and a SwiGLU MLP), the projections
        compute with the native kernel, and the model is one rank; False, and nothing
        changed, elsewhere."""
        if not kernels.stack_enabled() or self.ctx.layout.world_size != 1 or not self.layers:
            return False
        if self.local_rotary_emb is not None or self.rotary_emb.cos.dtype != torch.float32:
            return False
        layers: list[kernels.StackLayer] = []
        attentions: list[Attention] = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            if (type(attn) is not Attention or type(mlp) is not MLP or not mlp.silu
                    or attn.softcap or self.rotary_emb.cos.shape[-1] != attn.head_dim
                    or (attn.q_norm is None) != (attn.k_norm is None)
                    or layer.pre_feedforward_layernorm is not None):
                return False
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (any(p.native_op is None for p in projections)
                    or any(p.bias is not None for p in projections[1:])):
                return False
            layers.append(kernels.StackLayer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                attn.q_norm.weight if attn.q_norm is not None else None,
                attn.k_norm.weight if attn.k_norm is not None else None,
                attn.qkv_proj.bias, projections))
            attentions.append(attn)
            eps, intermediate = layer.input_layernorm.eps, mlp.down_proj.in_features
        attn = attentions[0]
        self.native_stack = kernels.DecoderStack.build(
            layers, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=intermediate, eps=eps, scale=attn.scale)
        self._stack_attentions = attentions
        return self.native_stack is not None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: token ids [T] on the first stage, else the previous stage's hidden states [T, E]."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # [T, E]
            if self.embedding_multiplier != 1.0:
                x = x * torch.tensor(self.embedding_multiplier, dtype=x.dtype)
        rotary = self.rotary_emb(meta.positions, x.dtype)
        delta: torch.Tensor | None = None
        if (self.native_stack is not None and meta.windowed is None
                and (meta.decode is None or meta.decode.tables is None)):
            caches = [attn.kv_cache for attn in self._stack_attentions]
            x, delta = self.native_stack(x, rotary, caches, meta)
        else:
            local = (self.local_rotary_emb(meta.positions, x.dtype)
                     if self.local_rotary_emb is not None else rotary)
            for layer, windowed in zip(self.layers, self.windowed, strict=True):
                x, delta = layer(x, delta, local if windowed else rotary, meta)
        if self.norm is not None:
            return self.norm.add_norm(x, delta)[1]
        return x if delta is None else x + delta


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        ctx = ctx or ParallelContext()
        self.config = cfg
        self.ctx = ctx
        self.model = DecoderModel(cfg, ctx)
        self.lm_head = (ParallelLMHead(cfg.hidden_size, cfg.vocab_size, ctx)
                        if ctx.is_last_stage else None)
        if cfg.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Last stage: logits [N, V] (float32) of the tokens in `meta.logits_index`, or, where
        `meta.argmax_only` and the head screens (`greedy_head`), their argmax [N] (int64);
        earlier stages: hidden states [T, E] for the next stage."""
        hidden = self.model(x, meta)
        if self.lm_head is None:
            return hidden
        rows = hidden[meta.logits_index]
        if meta.argmax_only and self.greedy_head is not None:
            tokens = self.greedy_head.tokens(rows)
            if tokens is not None:
                return tokens
        logits = self.lm_head(rows).float()
        if cap := self.config.final_logit_softcap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # Projections that keep their float weights in an int8 engine: their inputs have outliers
    # that one int8 scale per call cannot hold (the MLP's down projection, after SiLU x up) or
    # their outputs are the logits. Measured on SmolLM2 (perplexity over 1024 tokens, float32
    # 79.5): every projection in int8 120.2, all but the LM head 117.8, all but these two 84.0.
    FLOAT_IN_INT8 = ("down_proj", "lm_head")

    def quantize_linears(self) -> int:
        """Projections to int8 weights (layers.Linear.quantize_int8), but FLOAT_IN_INT8, which
        are packed as float; returns how many were quantized."""
        n = 0
        for name, m in self.named_modules():
            if not isinstance(m, Linear):
                continue
            if name.rsplit(".", 1)[-1] in self.FLOAT_IN_INT8:
                m.pack()
            else:
                m.quantize_int8()
                n += 1
        return n

    one_token_plain = False  # one-token steps read the plain float32 weights (pack_linears)
    native_linears = False  # projections compute with the native float32 kernel (pack_linears)
    greedy_head: GreedyHead | None = None  # argmax-only steps screen the LM head (pack_linears)

    def pack_linears(self, keep_plain: bool | None = None, native: bool | None = None) -> int:
        """Pre-pack every projection (CPU); returns how many were packed.

        float32 on an engine of one torch thread (the default where the machine has two
        cores), unless `native` is False: for the native kernel, which the engine's thread
        computes with an idle-CPU helper (models.kernels; 1.7x faster where a core is idle,
        as fast as oneDNN where none is: docs/engines.md, "Native CPU kernels"). Otherwise for
        oneDNN (float32, bfloat16 where the CPU has bf16 instructions: layers.packable);
        float32 projections then also keep their plain weights for one-token steps if
        `keep_plain`, or, when it is None, where this CPU reads them faster that way
        (layers.plain_reads_faster, logged)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        float32 = bool(linears) and all(m.weight.dtype == torch.float32 for m in linears)
        on_cpu = bool(linears) and all(m.weight.device.type == "cpu" for m in linears)
        if native is None:
            native = torch.get_num_threads() == 1
        kernel = kernels.native_linear() if native and float32 and on_cpu else None
        if kernel is not None:
            if self.lm_head is not None and self.ctx.layout.world_size == 1:
                # Before it is packed; the vocabulary's rows only (padding has none at tp 1).
                head = self.lm_head
                self.greedy_head = GreedyHead.build(head.weight[: head.vocab_size])
            # One huge-page mapping for all of them, in the order a step reads them.
            numels = [math.prod(kernel.packed_shape(*m.weight.shape)) for m in linears]
            arena = huge_page_empty(sum(numels), torch.float32)
            budget = NarrowerBudget(procfs.memory_available())
            for m, start, numel in zip(linears, itertools.accumulate([0, *numels]), numels,
                                       strict=False):
                m.pack_native(functools.partial(kernel.pack, out=arena[start:start + numel]),
                              kernel.op, functools.partial(budget.blocks, kernel.blocks))
            self.native_linears = True
            if budget.refused:
                log.warning("%d projections read float32 only: their narrower forms would "
                            "have passed a quarter of the memory available at load (%d MiB)",
                            budget.refused, (budget.available or 0) >> 20)
            narrow = [m for m in linears if m.native_blocks is not None]
            if narrow:
                faster, unpacked_s, panels_s = unpacked_reads_faster(narrow)
                torch.ops.llm_kernels.set_unpack_rows(UNPACK_ALL if faster else 0)
                log.info("%d rows through the projections with narrower forms: from the float32 "
                         "panels %.1f ms, those forms unpacked %.1f ms: steps of more than a "
                         "tile's rows read the %s", UNPACK_TIMING_ROWS, 1e3 * panels_s,
                         1e3 * unpacked_s, "narrower forms" if faster else "float32 panels")
            on_tiles = sum(torch.ops.llm_kernels.amx_levels_for(m.native_kind) for m in linears)
            if on_tiles:
                log.info("%d projections compute steps of 13 to 128 rows from their GGUF levels "
                         "on AMX tiles", on_tiles)
            forms = Counter(_narrower_form(m) for m in linears)
            log.info("projections: native float32 kernel on the engine thread and an idle-CPU "
                     "helper, read in steps of few rows %s (kernels.NativeLinear.blocks); greedy "
                     "rows' LM head %s; layers %s", ", ".join(f"{n} {form}" for form, n in
                                                            forms.items()),
                     _screened(self.greedy_head),
                     "in one native call a step (kernels.DecoderStack)"
                     if self.model.build_native_stack() else "one by one")
            return len(linears)
        try_plain = float32 and keep_plain is not False
        packed = [m for m in linears if m.pack(keep_plain=try_plain)]
        if try_plain and packed and keep_plain is None:
            keep_plain, plain_s, packed_s = plain_reads_faster(packed)
            log.info("one token through the projections: plain weights %.1f ms, packed %.1f ms: "
                     "one-token steps read the %s ones", 1e3 * plain_s, 1e3 * packed_s,
                     "plain" if keep_plain else "packed")
        self.one_token_plain = try_plain and bool(packed) and bool(keep_plain)
        if not self.one_token_plain:
            for m in packed:
                m.plain = None
        return len(packed)

    def attention_layers(self) -> list[Attention | LatentAttention]:
        return [m for m in self.modules() if isinstance(m, Attention | LatentAttention)]
