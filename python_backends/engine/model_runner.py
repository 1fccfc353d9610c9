"""Sequences in, the LM head's output out: packs one step's tokens, owns the KV pool, runs the
model."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from python_backends.config import EngineConfig
from python_backends.engine.cuda_graphs import DecodeGraphs
from python_backends.engine.loader import kv_layout
from python_backends.engine.sampler import HeadOutput, argmax_only
from python_backends.engine.scheduler import ScheduledSequence, SchedulerOutput
from python_backends.engine.sequence import Sequence
from python_backends.kv_transfer.layout import allocate_pool
from python_backends.models import gpu_attention, kernels
from python_backends.models.attention import (
    AttentionMetadata,
    DecodeBatch,
    PrefillSpan,
    causal_mask,
    window_mask,
    window_start,
)
from python_backends.models.decoder import Attention, CausalLM

log = logging.getLogger(__name__)
MicroBatch = tuple[torch.Tensor, AttentionMetadata]  # token ids [T], their metadata


class RankGroup(Protocol):
    """Rank 0's handle on an engine's other ranks, as the runner, the handoff and the engine use
    it (engine.ranks.RankGroup implements it). A protocol, so that engine.ranks, which builds
    every rank's runner here, is the only one of the two modules that imports the other."""

    config: EngineConfig

    @property
    def ranks_alive(self) -> int: ...

    def run(self, model: CausalLM, batches: list[MicroBatch]) -> list[torch.Tensor]:
        """One step: the micro-batches through every rank; the last stage's logits of each."""
        ...

    def gather_kv(self, pool: torch.Tensor, whole: torch.Tensor, blocks: list[int]) -> None: ...

    def scatter_kv(self, pool: torch.Tensor, whole: torch.Tensor, blocks: list[int]) -> None: ...

    def close(self, timeout_s: float = 10.0) -> None: ...


class ModelRunner:
    def __init__(self, model: CausalLM, kv_pool: torch.Tensor, block_size: int,
                 group: RankGroup | None = None, graph_rows: int = 0,
                 max_seq_len: int = 0) -> None:
        """`kv_pool`: [layers, 2, slots, kv_heads, head_dim] (see kv_transfer.layout), allocated
        once: the one region a KV transport maps or registers; this rank's slice under TP/PP.
        `group`: the other ranks, when the engine has more than one. `graph_rows`: decode steps
        of up to that many rows replay CUDA graphs (engine.cuda_graphs), where the model runs
        on a GPU and can be captured; 0: never. `max_seq_len`: the longest sequence (the
        graphs' block tables), default the model's positions.

        Steps are packed on the CPU and moved to the model's device once (see
        AttentionMetadata.to); every rank moves its own copy."""
        if kv_pool.device != model.ctx.device:
            raise ValueError(f"KV pool on {kv_pool.device}, model on {model.ctx.device}")
        self.model = model
        self.group = group
        self.block_size = block_size
        # Every layer's sliding window (0: none): each query's context is cut to it, so the
        # blocks a sequence released behind it (Scheduler._release_behind_window) are not read.
        self.window = model.config.window_everywhere
        # Where only some layers have one (Gemma), theirs: each step gets a windowed view too.
        self.layer_window = 0 if self.window else model.config.sliding_window
        self.kv_pool = kv_pool
        self.prepare_seconds = 0.0  # since start: packing steps' inputs (LLMEngine.step_seconds)
        self.kv_caches = list(kv_pool.unbind(0))  # one [2, S, K, D] view per layer
        for attn, cache in zip(model.attention_layers(), self.kv_caches, strict=True):
            attn.kv_cache = cache
        if kv_pool.device.type == "cpu":
            kernels.load()  # compiled (once per machine) or loaded now, not in a request's step
        # Decode rows carry block tables for the GPU kernel that reads the cache in place.
        self.block_tables = (gpu_attention.supports(kv_pool) and not self.window
                             and not self.layer_window
                             and all(isinstance(a, Attention) for a in model.attention_layers()))
        self.graphs: DecodeGraphs | None = None
        if graph_rows and kv_pool.is_cuda:
            why_not = ("a sliding window or latent attention" if not self.block_tables
                       else DecodeGraphs.refusal(model))
            if why_not is not None:
                log.info("decode steps run eagerly: %s", why_not)
            else:
                max_blocks = -(-(max_seq_len or model.config.max_position_embeddings)
                               // block_size)
                self.graphs = DecodeGraphs(model, graph_rows, max_blocks, block_size)

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Cache slots of token positions [start, end) of `seq`."""
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _slot_list(self, seq: Sequence, start: int, end: int) -> list[int]:
        """_slots as a list: in Python for a few positions (a decode row, a draft), where
        torch's per-call cost would dominate a step of many sequences."""
        if end - start > 32:
            return list(self._slots(seq, start, end).tolist())
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(
        self, scheduled: Seq[ScheduledSequence]
    ) -> tuple[torch.Tensor, AttentionMetadata, list[Sequence]]:
        start = time.perf_counter()
        try:
            return self._prepare(scheduled)
        finally:
            self.prepare_seconds += time.perf_counter() - start

    def _prepare(
        self, scheduled: Seq[ScheduledSequence]
    ) -> tuple[torch.Tensor, AttentionMetadata, list[Sequence]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        prompts: list[tuple[Sequence, int, int, int]] = []  # seq, first row, start, end
        decode_index: list[int] = []
        decodes: list[tuple[Sequence, int]] = []  # a decode row's sequence and context length
        logits_index: list[int] = []
        sampling: list[Sequence] = []
        t = 0
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_at(i) for i in range(start, end - len(item.draft)))
            input_ids.extend(item.draft)
            positions.extend(range(start, end))
            slot_mapping.extend(self._slot_list(seq, start, end))
            if n == 1 or item.draft:  # a decode row per position, over the context up to it
                decode_index.extend(range(t, t + n))
                decodes.extend((seq, start + 1 + i) for i in range(n))
            else:
                prompts.append((seq, t, start, end))
            t += n
            if item.samples:  # the last known token's logits, and each draft token's
                rows = range(t - 1 - len(item.draft), t)
                logits_index.extend(rows)
                sampling.extend([seq] * len(rows))
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
            prefills=tuple(self._prefill_span(*p, self.window) for p in prompts),
            decode=self._decode_batch(decode_index, decodes, self.window),
            logits_index=torch.tensor(logits_index, dtype=torch.long),
            argmax_only=bool(sampling) and all(argmax_only(s.params) for s in sampling),
        )
        if window := self.layer_window:
            meta = dataclasses.replace(meta, windowed=dataclasses.replace(
                meta, prefills=tuple(self._prefill_span(*p, window) for p in prompts),
                decode=self._decode_batch(decode_index, decodes, window)))
        return torch.tensor(input_ids, dtype=torch.long), meta, sampling

    def _prefill_span(self, seq: Sequence, row: int, start: int, end: int,
                      window: int) -> PrefillSpan:
        """Rows [row, row + end - start) computing positions [start, end) of `seq`, over its
        whole context, or over each query's `window` where it is not 0."""
        n = end - start
        if window and end > window:
            first = window_start(start, window)
            return PrefillSpan(row, row + n, end - first, self._slots(seq, first, end),
                               window_mask(start, end, window))
        if start > 0:
            return PrefillSpan(row, row + n, end, self._slots(seq, 0, end), causal_mask(n, end))
        return PrefillSpan(row, row + n, end, torch.empty(0, dtype=torch.long))

    def _decode_batch(self, rows: list[int], decodes: list[tuple[Sequence, int]],
                      window: int) -> DecodeBatch | None:
        """One query per row over its sequence's first `n_ctx` tokens, or the last of them in
        its `window` where it is not 0."""
        if not decodes:
            return None
        if self.block_tables:  # window 0 here: every context starts at its first block
            used = [-(-n_ctx // self.block_size) for _, n_ctx in decodes]
            longest = max(used)
            tables = torch.tensor([seq.block_table[:u] + [0] * (longest - u)
                                   for (seq, _), u in zip(decodes, used, strict=True)],
                                  dtype=torch.int32)
            return DecodeBatch(torch.tensor(rows), torch.empty(len(rows), 0, dtype=torch.long),
                               torch.tensor([n for _, n in decodes], dtype=torch.int32),
                               tables, self.block_size)
        firsts = [window_start(n_ctx - 1, window) if window else 0 for _, n_ctx in decodes]
        lens = [n_ctx - first for (_, n_ctx), first in zip(decodes, firsts, strict=True)]
        slots = torch.zeros(len(decodes), max(lens), dtype=torch.long)
        for i, ((seq, n_ctx), first) in enumerate(zip(decodes, firsts, strict=True)):
            slots[i, : n_ctx - first] = self._slots(seq, first, n_ctx)
        return DecodeBatch(torch.tensor(rows), slots, torch.tensor(lens))

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[HeadOutput, list[Sequence]]:
        """Compute the step; returns the head's output for the sampling sequences, in order."""
        if self.group is None:
            input_ids, meta, sampling = self.prepare(out.scheduled)
            if self.graphs is not None and (logits := self.graphs.run(input_ids, meta)) is not None:
                return HeadOutput.of(logits), sampling
            device = self.model.ctx.device
            return HeadOutput.of(self.model(input_ids.to(device), meta.to(device))), sampling
        batches, sampling = [], []
        for part in self._micro_batches(out.scheduled):
            input_ids, meta, seqs = self.prepare(part)
            batches.append((input_ids, meta))
            sampling.extend(seqs)
        return HeadOutput.of(torch.cat(self.group.run(self.model, batches))), sampling

    def _micro_batches(
        self, scheduled: tuple[ScheduledSequence, ...]
    ) -> list[tuple[ScheduledSequence, ...]]:
        """As many parts as pipeline stages (fewer for a small step), balanced by token count,
        so the stages overlap on different parts; one part without pipeline parallelism."""
        assert self.group is not None
        parts = min(self.group.config.parallel.pp, len(scheduled))
        if parts <= 1:
            return [scheduled]
        total = sum(s.num_tokens for s in scheduled)
        out: list[tuple[ScheduledSequence, ...]] = []
        current: list[ScheduledSequence] = []
        done = 0
        for i, item in enumerate(scheduled):
            current.append(item)
            done += item.num_tokens
            items_left = len(scheduled) - i - 1  # enough to give every later part one
            if (len(out) < parts - 1 and done >= total * (len(out) + 1) / parts
                    and items_left >= parts - 1 - len(out)):
                out.append(tuple(current))
                current = []
        if current:
            out.append(tuple(current))
        return out


def rank_runner(config: EngineConfig, model: CausalLM, num_kv_blocks: int,
                kv_pool: torch.Tensor | None = None, group: RankGroup | None = None,
                graph_rows: int = 0) -> ModelRunner:
    """The runner of rank `model.ctx.rank` over its KV slice (`kv_pool`, else allocated on the
    model's device). Every rank of an engine is built by this: rank 0 in LLMEngine, ranks
    1..N-1 in engine.ranks.rank_main. `group`: rank 0's handle on the others. `graph_rows`:
    as ModelRunner takes it."""
    if kv_pool is None:
        layout = kv_layout(config, num_kv_blocks, model.ctx.rank)
        kv_pool = allocate_pool(layout, device=model.ctx.device)
    return ModelRunner(model, kv_pool, config.limits.block_size, group, graph_rows,
                       config.limits.max_seq_len)
