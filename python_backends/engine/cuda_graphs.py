"""Decode steps as CUDA graphs: on a GPU a small model's decode step is bound by launching its
kernels one by one from Python (9.5 ms a step for a 135M-parameter model at batch 8 on an H200,
whose weights stream from memory in a tenth of that: docs/engines.md, "GPU serving"). Replaying
a captured graph launches the whole step at once.

One graph per rung of a ladder of row counts (1, 2, 4, 6, 8, 12, 16, 24, 32, ...), captured at load
from the largest down into one memory pool. A decode-only step of n rows is copied into the
static inputs of the smallest rung r >= n and that graph replays; rows n..r-1 are padding that
neither writes the cache (slot -1) nor reads it (context length 0). Block tables and context
lengths are graph inputs that the GPU kernels read (models.gpu_attention), so one graph serves
every step of its row count whatever the sequences' lengths and blocks. Prompts, chunks and
mixed steps run eagerly, as do steps larger than the last rung.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from python_backends.models.attention import AttentionMetadata, DecodeBatch
from python_backends.models.decoder import MLP, Attention, CausalLM

log = logging.getLogger(__name__)


class Replayable(Protocol):
    def replay(self) -> None: ...


@dataclass(frozen=True)
class StepInputs:
    """A decode step's inputs, as the graphs read them (int32, `rows` of each)."""

    ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    lens: torch.Tensor
    tables: torch.Tensor  # [rows, max_blocks]


def ladder(max_rows: int) -> list[int]:
    """Row counts to capture up to `max_rows` (its own rung last): powers of two and the
    halves between them, so padding wastes at most a third of a step."""
    rungs = [1, 2, 4]
    while rungs[-1] < max_rows:
        last = rungs[-1]
        rungs += [last + last // 2, 2 * last]
    return sorted({r for r in rungs if r < max_rows} | {max_rows})


class DecodeGraphs:
    def __init__(self, model: CausalLM, max_rows: int, max_blocks: int, block_size: int) -> None:
        """`max_rows`: the largest decode step replayed; `max_blocks`: the longest block table
        (max_seq_len / block_size). Captures every rung now."""
        device = model.ctx.device
        self.model = model
        self.block_size = block_size
        self.rungs = ladder(max_rows)
        rows = self.rungs[-1]
        # Every input in one int32 buffer, filled on the host in a pinned twin and copied over
        # in one transfer a step: token ids, positions, slots, context lengths, block tables.
        size = rows * (4 + max_blocks)
        self.static = torch.zeros(size, dtype=torch.int32, device=device)
        self.staging = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.inputs = self._views(self.static, rows, max_blocks)
        self.staged = self._views(self.staging, rows, max_blocks)
        self.staged.slot_mapping.fill_(-1)
        self.row_index = torch.arange(rows, device=device)
        self.graphs: dict[int, tuple[Replayable, torch.Tensor]] = {}
        self.replays = 0  # steps replayed since load
        start = time.perf_counter()
        self._capture()
        log.info("decode steps as CUDA graphs: %d rungs up to %d rows captured in %.1f s",
                 len(self.rungs), rows, time.perf_counter() - start)

    @staticmethod
    def _views(buffer: torch.Tensor, rows: int, max_blocks: int) -> StepInputs:
        ids, positions, slots, lens, tables = buffer.split([rows] * 4 + [rows * max_blocks])
        return StepInputs(ids, positions, slots, lens, tables.view(rows, max_blocks))

    @staticmethod
    def refusal(model: CausalLM) -> str | None:
        """Why `model`'s decode step cannot be captured, or None: every layer must be the
        plain attention and MLP (a mixture of experts routes tokens with host-side counts),
        on one rank (NCCL's collectives between ranks are outside the graph)."""
        if model.ctx.layout.world_size > 1:
            return "more than one rank"
        for layer in model.model.layers:
            if not isinstance(layer.self_attn, Attention) or not isinstance(layer.mlp, MLP):
                return "a layer with latent attention or experts"
        return None

    def _meta(self, rows: int) -> AttentionMetadata:
        index, inputs = self.row_index[:rows], self.inputs
        decode = DecodeBatch(index, index.new_empty(rows, 0), inputs.lens[:rows],
                             inputs.tables[:rows], self.block_size)
        return AttentionMetadata(positions=inputs.positions[:rows],
                                 slot_mapping=inputs.slot_mapping[:rows], prefills=(),
                                 decode=decode, logits_index=index)

    @torch.inference_mode()
    def _capture(self) -> None:
        # On the model's GPU, whichever is current on the loading thread (KIND_GPU on GPU 1).
        with torch.cuda.device(self.static.device):
            pool = torch.cuda.graph_pool_handle()
            for rows in reversed(self.rungs):  # the largest first: the smaller reuse its memory
                self.graphs[rows] = self._record(self.inputs.ids[:rows], self._meta(rows), pool)
            torch.cuda.synchronize()

    def _record(self, ids: torch.Tensor, meta: AttentionMetadata,
                pool: Any) -> tuple[Replayable, torch.Tensor]:
        """One rung's graph, and the logits tensor its replays write."""
        side = torch.cuda.Stream(ids.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # once eagerly: kernels compiled, libraries set up
            self.model(ids, meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.model(ids, meta)
        return graph, out

    def rung(self, rows: int) -> int | None:
        """The rung that replays a step of `rows` rows, or None where none is that large."""
        i = bisect.bisect_left(self.rungs, rows)
        return self.rungs[i] if i < len(self.rungs) else None

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The logits of `meta.logits_index` for a step packed on the CPU, by replaying a graph,
        or None where the step is not one (prompts in it, or more rows than the last rung)."""
        d = meta.decode
        if meta.prefills or d is None or d.tables is None or meta.windowed is not None:
            return None
        n = input_ids.shape[0]
        rows = self.rung(n)
        if rows is None or d.tables.shape[1] > self.staged.tables.shape[1]:
            return None
        staged = self.staged
        staged.ids[:n] = input_ids
        staged.positions[:n] = meta.positions
        staged.slot_mapping[:n] = meta.slot_mapping
        staged.slot_mapping[n:rows] = -1
        staged.lens[:n] = d.lens
        staged.lens[n:rows] = 0
        staged.tables[:n, : d.tables.shape[1]] = d.tables
        self.static.copy_(self.staging, non_blocking=True)
        graph, out = self.graphs[rows]
        graph.replay()
        self.replays += 1
        index = meta.logits_index
        if len(index) == n and (n == 0 or int(index[-1]) == n - 1):  # rows 0..n-1, in order
            return out[:n]
        return out[index.to(out.device, non_blocking=True)]
