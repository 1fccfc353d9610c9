"""Where this process sits in its engine's parallel group, and the collectives it needs.

A single-rank context (the default) makes every collective a no-op, so the model code is the
same for one rank and many.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from python_backends.config import ParallelLayout
from python_backends.parallel.placement import CPU


@dataclass(frozen=True)
class ParallelContext:
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    rank: int = 0  # in the engine's group: local rank + stage_size * pipeline stage
    group: Any = None  # torch.distributed group of this stage's ranks
    device: torch.device = CPU  # where this rank's weights, KV slice and activations live
    logits_group: Any = None  # rank 0 and the last stage's first rank (pipeline parallelism)

    @property
    def local_rank(self) -> int:
        return self.rank % self.layout.stage_size

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def tp_rank(self) -> int:
        return self.local_rank % self.layout.tp  # 0 everywhere when attention is replicated

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        return self.local_rank % self.layout.ep

    @property
    def pp_rank(self) -> int:
        return self.rank // self.layout.stage_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def rank_of(self, stage: int, local_rank: int | None = None) -> int:
        local = self.local_rank if local_rank is None else local_rank
        return stage * self.layout.stage_size + local

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's tensor-parallel ranks, in place."""
        if self.tp_size > 1:
            with timed("all_reduce"):
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the tensor-parallel ranks' shards along the last dimension, in order."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        with timed("all_gather"):
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int]) -> torch.Tensor:
        """Rows [sum(send_counts[:r]), ...) go to expert-parallel rank r; returns the rows
        received, ordered by sender."""
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        with timed("all_to_all"):
            dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts,
                                   group=self.group)
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """What every expert-parallel rank will send me, given what I send each of them."""
        out = torch.empty_like(send_counts)
        with timed("all_to_all"):
            dist.all_to_all_single(out, send_counts, group=self.group)
        return out

    def all_gather_rows(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate the expert-parallel ranks' row blocks (rank r holds sizes[r] rows)."""
        longest = max(sizes)
        padded = x.new_zeros(longest, *x.shape[1:])
        padded[: len(x)] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        with timed("all_gather"):
            dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


class CommTimer:
    """Seconds spent in collectives and point-to-point transfers, by kind (for benchmarks)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.enabled = False

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


COMM = CommTimer()


@contextmanager
def timed(kind: str) -> Iterator[None]:
    if not COMM.enabled:
        yield
        return
    _sync()  # on a GPU, time the transfer, not the kernels queued before it
    start = time.perf_counter()
    try:
        yield
    finally:
        _sync()
        COMM.seconds[kind] = COMM.seconds.get(kind, 0.0) + time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
