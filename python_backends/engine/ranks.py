"""The rank processes of one engine instance, driven by rank 0.

Rank 0 lives in the serving process (the Triton stub): it schedules, and for every step
broadcasts the step's micro-batches (token ids and attention metadata: a few KB) to ranks
1..N-1, which it started as child processes (`python -m python_backends.engine.ranks`), then
computes its own part. Inside a stage the tensor-parallel ranks meet in the layers' collectives;
between stages hidden states go point to point, one micro-batch at a time, so stage s works on
micro-batch i + 1 while stage s + 1 works on micro-batch i. The last stage sends the logits to
rank 0. Every rank holds only its own shards and its own slice of the KV cache, on its own
device (engine.placement): gloo on CPU; on GPUs NCCL moves the tensors and gloo the control
messages (the step broadcast carries CPU tensors; each rank moves them to its GPU).

A rank that dies is noticed before the next step (or by the failing collective) and reported as
`RankFailure` naming the rank and its exit status; ranks exit when their parent process is gone
(`_die_with_parent`), so a killed stub leaves no orphans.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from python_backends.config import RANK_MODULE, EngineConfig
from python_backends.diagnostics import set_up_process
from python_backends.engine.loader import DTYPES, load_model
from python_backends.engine.model_runner import MicroBatch, rank_runner
from python_backends.models.decoder import CausalLM
from python_backends.net import free_port
from python_backends.parallel.context import ParallelContext, timed
from python_backends.parallel.placement import CPU, dist_backend

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 300.0


class RankFailure(RuntimeError):
    """A rank of the engine's parallel group died or stopped answering."""


def threads_per_rank(world_size: int, cpu_threads: int = 0) -> int:
    """torch intra-op threads of each rank of an engine: its `cpu_threads` (0: every core but
    one, which Triton, the other stubs and co-located clients need) split over its ranks, at
    least 1. Why not every core: an OpenMP team whose threads outnumber the cores left free
    waits at every parallel region for a thread the kernel descheduled, hundreds of times a
    step, and a stream slows to a crawl (docs/engines.md, "CPU threads")."""
    total = cpu_threads or max(1, (os.cpu_count() or 1) - 1)
    return max(1, total // world_size)


def join_group(rank: int, world_size: int, port: int, config: EngineConfig,
               timeout_s: float, device: torch.device = CPU) -> ParallelContext:
    """Rendezvous of all ranks; every rank creates every stage's group (the calls must match
    across ranks) and keeps its own.

    Under pipeline parallelism the last stage returns logits to rank 0 over a group of its
    own: rank 0 and the last stage's first rank also pass hidden states forward, and on NCCL
    one pair's sends and receives share one stream, where rank 0's send of micro-batch i + 1
    would wait for a receive queued behind the logits of micro-batch i."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicators bind to the current device
    dist.init_process_group(dist_backend(device), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    layout = config.parallel
    size = layout.stage_size
    mine = None
    for stage in range(layout.pp):
        group = dist.new_group(list(range(stage * size, (stage + 1) * size)))
        if rank // size == stage:
            mine = group
    logits_group = None
    if layout.pp > 1:
        last = (layout.pp - 1) * size  # the last stage's first rank
        logits_group = dist.new_group([0, last])
    return ParallelContext(layout, rank, mine, device, logits_group)


def run_stage(model: CausalLM, ctx: ParallelContext, batches: Sequence[MicroBatch],
              dtype: torch.dtype) -> list[torch.Tensor]:
    """This rank's part of one step: the logits of every micro-batch on rank 0, else [].
    `dtype`: the engine's (of the hidden states passed between stages)."""
    cfg = model.config
    logits: list[torch.Tensor] = []
    sends: list[tuple[Any, torch.Tensor]] = []  # (pending isend, the tensor it reads)
    for ids, cpu_meta in batches:
        x, meta = ids.to(ctx.device), cpu_meta.to(ctx.device)
        if not ctx.is_first_stage:
            x = torch.empty(len(ids), cfg.hidden_size, dtype=dtype, device=ctx.device)
            with timed("send_recv"):
                dist.recv(x, src=ctx.rank_of(ctx.pp_rank - 1))
        y = model(x, meta)
        if not ctx.is_last_stage:
            with timed("send_recv"):
                sends.append((dist.isend(y, dst=ctx.rank_of(ctx.pp_rank + 1)), y))
        elif ctx.rank == 0:
            logits.append(y)
        elif ctx.local_rank == 0 and len(y):
            with timed("send_recv"):
                sends.append((dist.isend(y, dst=0, group=ctx.logits_group), y))
    if ctx.rank == 0 and not ctx.is_last_stage:
        last = ctx.rank_of(ctx.layout.pp - 1, 0)
        for _, meta in batches:
            buf = torch.empty(len(meta.logits_index), cfg.vocab_size, dtype=torch.float32,
                              device=ctx.device)
            if len(buf):
                with timed("send_recv"):
                    dist.recv(buf, src=last, group=ctx.logits_group)
            logits.append(buf)
    for work, _ in sends:
        work.wait()
    return logits


class RankGroup:
    """Rank 0's handle on the group: starts ranks 1..N-1, runs steps, stops them."""

    def __init__(self, engine_dir: str | Path, config: EngineConfig, num_kv_blocks: int,
                 devices: Sequence[torch.device] | None = None,
                 timeout_s: float = STARTUP_TIMEOUT_S, threads: int = 1) -> None:
        """`devices`: rank r's device (default: all on the CPU; see parallel.placement).
        `threads`: torch intra-op threads of every rank (threads_per_rank)."""
        self.config = config
        self.dtype = DTYPES[config.dtype]
        world = config.parallel.world_size
        self.devices = devices = list(devices or [CPU] * world)
        port = free_port()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._failure_logged = False
        for rank in range(1, world):
            self.procs[rank] = subprocess.Popen(
                [_python(), "-m", RANK_MODULE, "--engine-dir",
                 str(engine_dir), "--rank", str(rank), "--port", str(port),
                 "--num-kv-blocks", str(num_kv_blocks), "--device", str(devices[rank]),
                 "--threads", str(threads)],
                env={**os.environ, "OMP_NUM_THREADS": str(threads)},
            )
        try:
            self.ctx = join_group(0, world, port, config, timeout_s, devices[0])
        except Exception as e:
            self._kill()
            raise RankFailure(f"the engine's {world} ranks did not meet: {e}; "
                              f"{self._exit_codes()}") from e

    def wait_ready(self) -> None:
        """Return once every rank has loaded its shards (they load in parallel with rank 0)."""
        try:
            dist.barrier()
        except RuntimeError as e:
            self._kill()
            raise RankFailure(f"an engine rank failed while loading: {e}; "
                              f"{self._exit_codes()}") from e

    def check(self) -> None:
        """Raise RankFailure if a rank has exited (logged once, when first seen)."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                message = (f"engine rank {rank} (pid {proc.pid}) exited with status {code}; "
                           "the instance cannot compute until it is reloaded")
                if not self._failure_logged:
                    log.error("%s", message)
                    self._failure_logged = True
                raise RankFailure(message)

    @property
    def ranks_alive(self) -> int:
        """Ranks running, this one included (for the health gauge; checks without raising)."""
        with contextlib.suppress(RankFailure):
            self.check()  # logs a death once
        return 1 + sum(p.poll() is None for p in self.procs.values())

    def run(self, model: CausalLM, batches: list[MicroBatch]) -> list[torch.Tensor]:
        self.check()
        try:
            with timed("broadcast"):
                dist.broadcast_object_list([("step", batches)], src=0)
            return run_stage(model, self.ctx, batches, self.dtype)
        except RuntimeError as e:  # a collective failed: another rank died mid-step
            self.check()
            raise RankFailure(f"engine rank group failed mid-step: {e}") from e

    def gather_kv(self, pool: torch.Tensor, whole: torch.Tensor, blocks: list[int]) -> None:
        """Gather `blocks` from every rank's KV slice into `whole` (rank 0's whole-model pool)."""
        self._collective("gather_kv", blocks, pool, whole)

    def scatter_kv(self, pool: torch.Tensor, whole: torch.Tensor, blocks: list[int]) -> None:
        """Scatter `blocks` of `whole` to every rank's KV slice."""
        self._collective("scatter_kv", blocks, pool, whole)

    def _collective(self, kind: str, blocks: list[int], pool: torch.Tensor,
                    whole: torch.Tensor) -> None:
        self.check()
        try:
            dist.broadcast_object_list([(kind, blocks)], src=0)
            exchange_kv(self.ctx, self.config, pool, blocks, kind, whole)
        except RuntimeError as e:
            self.check()
            raise RankFailure(f"engine rank group failed moving KV: {e}") from e

    def close(self, timeout_s: float = 10.0) -> None:
        if not self.procs:
            return
        try:
            if all(p.poll() is None for p in self.procs.values()):
                dist.broadcast_object_list([("stop", None)], src=0)
        except RuntimeError:
            pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        self._kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.procs = {}

    def _kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def _exit_codes(self) -> str:
        return ", ".join(f"rank {r}: {'running' if p.poll() is None else f'exit {p.poll()}'}"
                         for r, p in self.procs.items())


def exchange_kv(ctx: ParallelContext, config: EngineConfig, pool: torch.Tensor,
                blocks: list[int], kind: str, whole: torch.Tensor | None = None) -> None:
    """Move the KV of `blocks` between each rank's slice `pool` ([layers of its stage, planes,
    slots, its KV heads, D]) and rank 0's whole-model pool `whole` (every layer and head), point to
    point. gather_kv: from the ranks into `whole` (one holder per distinct slice: ranks that
    replicate attention hold the same KV); scatter_kv: from `whole` to every rank."""
    bs = config.limits.block_size
    slots = (torch.tensor(blocks).unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)
    slots = slots.to(pool.device)
    layout = config.parallel
    heads = pool.shape[3]  # this rank's share; every rank holds as many
    if ctx.rank != 0:
        if kind == "scatter_kv":
            part = pool.new_empty(pool.shape[0], pool.shape[1], len(slots), *pool.shape[3:])
            with timed("send_recv"):
                dist.recv(part, src=0)
            pool.index_copy_(2, slots, part)
        elif ctx.local_rank < layout.tp:
            with timed("send_recv"):
                dist.send(pool.index_select(2, slots), dst=0)
        return
    assert whole is not None
    for rank in range(layout.world_size):
        other = ParallelContext(layout, rank)
        if kind == "gather_kv" and other.local_rank >= layout.tp:
            continue
        layers = layout.stage_layers(config.model.num_layers, other.pp_rank)
        h0 = other.tp_rank * heads
        region = whole[layers.start:layers.stop, :, :, h0:h0 + heads]  # a view into `whole`
        if kind == "gather_kv":
            if rank == 0:
                part = pool.index_select(2, slots)
            else:
                part = whole.new_empty(len(layers), whole.shape[1], len(slots), heads,
                                       whole.shape[-1])
                with timed("send_recv"):
                    dist.recv(part, src=rank)
            region.index_copy_(2, slots, part)
        else:
            part = region.index_select(2, slots)
            if rank == 0:
                pool.index_copy_(2, slots, part)
            else:
                with timed("send_recv"):
                    dist.send(part.contiguous(), dst=rank)


def _python() -> str:
    """The interpreter for rank processes. Inside a Triton stub sys.executable is not Python;
    the stub runs the environment of the first python3 on PATH (see docs/platform.md)."""
    exe = Path(sys.executable)
    if exe.name.startswith("python"):
        return str(exe)
    return shutil.which("python3") or str(Path(sys.prefix) / "bin" / "python3")


def _die_with_parent(poll_s: float = 0.2) -> None:
    """Exit within `poll_s` once the process that started this rank is gone (it was re-parented).
    Not PR_SET_PDEATHSIG: that fires when the parent *thread* ends, and rank 0 starts its ranks
    on a thread that ends once the engine is loaded (engine_loop.build_off_thread)."""
    parent = os.getppid()
    if parent == 1:  # the parent is already gone
        sys.exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def rank_main(argv: list[str] | None = None) -> int:
    """Ranks 1..N-1: join, load this rank's shards and KV slice, then follow rank 0."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--num-kv-blocks", type=int, required=True)
    ap.add_argument("--device", type=torch.device, default=CPU)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    _die_with_parent()
    set_up_process(f"{Path(args.engine_dir).name} rank {args.rank}")
    config = EngineConfig.load(args.engine_dir)
    torch.set_num_threads(args.threads)
    ctx = join_group(args.rank, config.parallel.world_size, args.port, config, STARTUP_TIMEOUT_S,
                     args.device)
    runner = rank_runner(config, load_model(args.engine_dir, config, ctx), args.num_kv_blocks)
    model, pool = runner.model, runner.kv_pool
    dist.barrier()  # loaded: see RankGroup.wait_ready
    while True:
        msg: list[object] = [None]
        dist.broadcast_object_list(msg, src=0)
        kind, payload = cast(tuple[str, Any], msg[0])
        if kind == "stop":
            break
        with torch.inference_mode():
            if kind == "step":
                run_stage(model, ctx, payload, DTYPES[config.dtype])
            else:
                exchange_kv(ctx, config, pool, payload, kind)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
