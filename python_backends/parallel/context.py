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


@dataclass(frozen=True)
class ParallelContext:
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    rank: int = 0  # in the engine's group: tp rank + tp * pipeline stage
    tp_group: Any = None  # torch.distributed group of this stage's tensor-parallel ranks

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.layout.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.layout.tp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def rank_of(self, stage: int, tp_rank: int | None = None) -> int:
        return stage * self.layout.tp + (self.tp_rank if tp_rank is None else tp_rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's tensor-parallel ranks, in place."""
        if self.tp_size > 1:
            with timed("all_reduce"):
                dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' shards along the last dimension, in tensor-parallel order."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        with timed("all_gather"):
            dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


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
    start = time.perf_counter()
    try:
        yield
    finally:
        COMM.seconds[kind] = COMM.seconds.get(kind, 0.0) + time.perf_counter() - start
