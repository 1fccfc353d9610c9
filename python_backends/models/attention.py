"""Paged attention over a flat slot-addressed KV cache.

Shapes use: T tokens in the step (all sequences packed), H query heads, K KV heads, D head size,
S slots in the cache (num_blocks * block_size), B decoding sequences, L longest context among them.

A step mixes sequences that compute many tokens (prompts, chunks, resumed sequences) with
sequences that compute one (decodes). The former run one attention call each, the latter are
gathered into one padded batch: on a CPU the per-call overhead of 30 layers x B sequences would
otherwise dominate a decode step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from python_backends.models import gpu_attention, kernels


@dataclass(frozen=True)
class PrefillSpan:
    """A sequence computing `end - start` tokens this step over a context of `context_len`."""

    start: int  # first token index in the packed step
    end: int
    context_len: int  # tokens in the cache after this step, including the new ones
    context_slots: torch.Tensor  # [context_len] slots holding the context, in order
    # [n, context_len] which context tokens each query sees, where not simply all before it
    # within this step's own tokens (a cached context, or a sliding window); None: causal
    # attention over this step's keys and values alone.
    mask: torch.Tensor | None = None

    def to(self, device: torch.device) -> PrefillSpan:
        return PrefillSpan(self.start, self.end, self.context_len,
                           _to(self.context_slots, device), _opt(self.mask, device))


@dataclass(frozen=True)
class DecodeBatch:
    """Each row's context as slots (the CPU's kernel and torch's SDPA gather them), or, where
    `tables` is set, as its sequence's blocks, which the GPU kernel reads in place
    (models.gpu_attention; `slots` is then [B, 0])."""

    token_index: torch.Tensor  # [B] index of each decoding token in the packed step
    slots: torch.Tensor  # [B, L] slots of each context, padded with slot 0
    lens: torch.Tensor  # [B] context length of each sequence (its first lens[b] slots)
    tables: torch.Tensor | None = None  # [B, M] int32: each row's block table, padded with 0
    block_size: int = 0  # tokens per block, where `tables` is set

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, 1, L] True where the slot belongs to the context."""
        longest = self.slots.shape[1]
        arange = torch.arange(longest, device=self.slots.device)
        return (arange[None, :] < self.lens[:, None])[:, None, None, :]

    def to(self, device: torch.device) -> DecodeBatch:
        return DecodeBatch(_to(self.token_index, device), _to(self.slots, device),
                           _to(self.lens, device), _opt(self.tables, device), self.block_size)


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    prefills: tuple[PrefillSpan, ...]
    decode: DecodeBatch | None
    logits_index: torch.Tensor  # [N] tokens whose logits are sampled
    # Every sampled row wants only its greedy token (no log-probabilities, penalties or bans):
    # the model may return the argmax instead of the logits (models.greedy_head).
    argmax_only: bool = False
    # Where only some layers have a sliding window (Gemma), the same step as those see it:
    # each query's context cut to its window. None where every layer or none has one.
    windowed: AttentionMetadata | None = None

    @classmethod
    def one_prompt(cls, n: int) -> AttentionMetadata:
        """One uncached prompt of `n` tokens alone, its KV in slots 0..n-1 and logits at every
        position: a forward pass outside the engine's scheduler (perplexity, tests)."""
        return cls(positions=torch.arange(n), slot_mapping=torch.arange(n),
                   prefills=(PrefillSpan(0, n, n, torch.empty(0, dtype=torch.long)),),
                   decode=None, logits_index=torch.arange(n))

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same metadata on `device` (built on the CPU, moved once per step)."""
        if self.positions.device == device:
            return self
        return AttentionMetadata(
            positions=_to(self.positions, device),
            slot_mapping=_to(self.slot_mapping, device),
            prefills=tuple(p.to(device) for p in self.prefills),
            decode=self.decode.to(device) if self.decode is not None else None,
            logits_index=_to(self.logits_index, device),
            argmax_only=self.argmax_only,
            windowed=self.windowed.to(device) if self.windowed is not None else None,
        )


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True)


def _opt(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else _to(t, device)


def causal_mask(n: int, context_len: int) -> torch.Tensor:
    """[n, context_len]: query i (at position context_len - n + i) sees positions <= its own."""
    rows = torch.arange(n).unsqueeze(1) + (context_len - n)
    return torch.arange(context_len).unsqueeze(0) <= rows


def window_start(position: int, window: int) -> int:
    """The first position a query at `position` sees under a sliding window of `window` keys
    (itself included), as Hugging Face masks it."""
    return max(0, position - window + 1)


def window_mask(start: int, end: int, window: int) -> torch.Tensor:
    """[end - start, end - window_start(start, window)]: queries at positions [start, end) over
    the keys from the first one's window start, each seeing its own window."""
    first = window_start(start, window)
    queries = torch.arange(start, end).unsqueeze(1)
    keys = torch.arange(first, end).unsqueeze(0)
    return (keys <= queries) & (keys > queries - window)


def write_kv(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the step's keys and values. cache: [2, S, K, D]; k, v: [T, K, D]. On a GPU a
    negative slot writes nothing (a CUDA graph's padding rows: engine.cuda_graphs)."""
    if gpu_attention.supports(cache):
        gpu_attention.write_kv(cache, k, v, slot_mapping)
        return
    cache[0].index_copy_(0, slot_mapping, k)
    cache[1].index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of the step's queries over each sequence's cached context; `softcap`
    (Gemma 2): scores s become softcap * tanh(s / softcap) before the softmax.

    q: [T, H, D]; k, v: [T, K, D] (already written to `cache`). Returns [T, H, D].
    """
    if meta.decode is not None and not meta.prefills:  # every token a decode, in step order
        return decode_attention(q, cache, meta.decode, scale, softcap)
    tiles = prompt_attention_on_tiles(q, softcap)
    if tiles is not None:
        q = q.contiguous()
        out = torch.empty_like(q)
        _prompts_on_tiles(tiles, q, k, v, cache, meta.prefills, scale, out)
    else:
        out = torch.empty_like(q)
        _prompts_in_sdpa(q, k, v, cache, meta.prefills, scale, softcap, out)
    if meta.decode is not None:
        d = meta.decode
        out[d.token_index] = decode_attention(q[d.token_index], cache, d, scale, softcap)
    return out


def span_kv(span: PrefillSpan, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What a prompt's queries attend over: [L, K, D] keys and values, and its mask [n, L]
    (PrefillSpan.mask). With nothing cached before (no mask: causal) this step's own, else the
    context's, gathered from the cache with this step's at its end."""
    if span.mask is None:
        return k[span.start : span.end], v[span.start : span.end], None
    return (cache[0].index_select(0, span.context_slots),
            cache[1].index_select(0, span.context_slots), span.mask)


def _prompts_on_tiles(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cache: torch.Tensor, spans: tuple[PrefillSpan, ...], scale: float,
                      out: torch.Tensor) -> None:
    """Every prompt's rows of `out` in one native call (prompt_attention_on_tiles)."""
    keys, values, masks, bounds = [], [], [], []
    for span in spans:
        ks, vs, mask = span_kv(span, k, v, cache)
        bounds += [span.start, span.end]
        keys.append(ks)
        values.append(vs)
        masks.append(_NO_MASK if mask is None else mask)
    kernel(q, out, bounds, keys, values, masks, scale)


def _prompts_in_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                     spans: tuple[PrefillSpan, ...], scale: float, softcap: float,
                     out: torch.Tensor) -> None:
    """Every prompt's rows of `out`, one torch SDPA call each."""
    for span in spans:
        # [1, heads, n, D]: batched 4-D operands take torch's flash kernel on the CPU, which is
        # much faster than the math fallback that 3-D operands get.
        ks, vs, mask = span_kv(span, k, v, cache)
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0)
                      for t in (q[span.start : span.end], ks, vs))
        o = sdpa(qs, ks, vs, mask, scale, softcap, causal=mask is None)
        out[span.start : span.end] = o[0].transpose(0, 1)


_NO_MASK = torch.empty(0, dtype=torch.bool)


def prompt_attention_on_tiles(q: torch.Tensor, softcap: float) -> Any | None:
    """The native kernel for prompts' attention on AMX tiles (csrc/prompt_attention.cpp) where it
    computes these queries: float32 on a CPU with tiles, no softcap, a head size in 32s. The
    native decoder stack (csrc/decoder_stack.cpp) takes it under the same conditions, so both
    paths give the same bits."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or softcap or q.shape[-1] % 32:
        return None
    return kernels.prompt_attention()


def decode_attention(q: torch.Tensor, cache: torch.Tensor, d: DecodeBatch,
                     scale: float, softcap: float = 0.0) -> torch.Tensor:
    """One query token per decoding sequence over its cached context. q: [B, H, D] -> [B, H, D].

    Where the batch carries block tables the Triton kernel reads each context in place
    (models.gpu_attention: GPUs); on the CPU the native kernel does (paged_attention.cpp);
    elsewhere, or without them, the contexts are gathered into a padded batch for SDPA."""
    if d.tables is not None:
        return gpu_attention.decode_attention(q, cache, d.tables, d.lens, d.block_size, scale,
                                              softcap)
    if q.device.type == "cpu" and cache.is_contiguous() and not softcap:
        kernel = kernels.paged_decode_attention()
        if kernel is not None:
            return kernel(q.contiguous(), cache, d.slots, d.lens, scale)
    return gathered_decode_attention(q, cache, d, scale, softcap)


def gathered_decode_attention(q: torch.Tensor, cache: torch.Tensor, d: DecodeBatch,
                              scale: float, softcap: float = 0.0) -> torch.Tensor:
    """decode_attention in torch ops: the contexts copied into one padded batch, then SDPA."""
    b, longest = d.slots.shape
    kv_shape = (b, longest, *cache.shape[2:])
    flat = d.slots.view(-1)
    # index_select, not advanced indexing: ~5x faster gathers on CPU.
    kd = cache[0].index_select(0, flat).view(kv_shape).transpose(1, 2)  # [B, K, L, D]
    vd = cache[1].index_select(0, flat).view(kv_shape).transpose(1, 2)
    return sdpa(q.unsqueeze(2), kd, vd, d.mask, scale, softcap).squeeze(2)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float, softcap: float = 0.0, causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention (grouped KV heads). 16-bit floats on the CPU are computed in
    float32: torch's CPU kernel is many times slower in bfloat16 (docs/platform.md), and the
    operands are small next to the weights that 16-bit engines are for."""
    if softcap:
        return _softcapped(q, k, v, mask, scale, softcap, causal)
    if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
        o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                           is_causal=causal, scale=scale, enable_gqa=True)
        return o.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=True)


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float, softcap: float, causal: bool) -> torch.Tensor:
    """_sdpa with capped scores, written out (torch's kernels have no cap), as Hugging Face's
    eager Gemma 2 computes it: q [B, H, n, D], k and v [B, K, L, D]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = causal_mask(q.shape[2], k.shape[2]).to(q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
