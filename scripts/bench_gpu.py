#!/usr/bin/env python3
"""The engine on one GPU against the memory roofline: decode step time with CUDA graphs off and
on, the KV handoff's CUDA IPC bandwidth between two processes, and what NIXL makes of GPU memory.

    python scripts/bench_gpu.py                        # batches 1, 8, 64, 256; bfloat16
    python scripts/bench_gpu.py --batches 8 --steps 16 --dtype float32

The model is a random-weight Llama of SmolLM2-135M's shape (30 layers, width 576, 9 query and
3 KV heads, vocabulary 49152, tied embeddings), built as an engine of --dtype. Per batch size:
that many prompts of --prompt-tokens tokens are computed, then --steps decode steps are timed
one by one (each step ends with its tokens on the host). A step reads every weight once and
each row's context of KV: those bytes over the step's time, against the GPU's memory bandwidth
(the datasheet's, and a device-to-device copy measured in the same run), is the fraction of the
roofline printed. Needs CUDA; scripts/gpu_check.sh runs it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from python_backends.config import EngineLimits
from python_backends.engine.builder import write_engine
from python_backends.engine.llm_engine import LLMEngine
from python_backends.parallel.placement import Placement
from python_backends.params import SamplingParams

SHAPE: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
    tie_word_embeddings=True)
DATASHEET_TBS = {"H200": 4.8, "H100": 3.35}  # HBM bandwidth by the vendor's datasheets, TB/s
BLOCK = 16
HEADROOM = 64  # output tokens beyond the timed steps: the prompts' own steps come first


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy, bytes read and written per second (mean of 10 after 3)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / seconds


def build(root: Path, dtype: str, max_rows: int, max_seq_len: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    limits = EngineLimits(max_seq_len=max_seq_len, max_num_seqs=max_rows,
                          max_num_batched_tokens=8192, block_size=BLOCK)
    out = root / f"smollm2-shape-{dtype}"
    write_engine(model, None, out, limits, dtype, "random", log=lambda _m: None)
    return out


def decode_steps(engine: LLMEngine, batch: int, args: argparse.Namespace
                 ) -> tuple[list[float], dict[str, float]]:
    """Seconds of each of `args.steps` decode steps of `batch` sequences (the prompts take
    several steps, so the first ones are ahead; all are aborted after the timed steps)."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=args.steps + HEADROOM)  # random weights, no end id
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", torch.randint(1, SHAPE["vocab_size"],
                                                         (args.prompt_tokens,),
                                                         generator=g).tolist(), params)
    started = 0
    while started < batch:  # the prompts' steps
        started += sum(1 for e in engine.step() if e.num_output_tokens == 1)
    times = []
    phases = dict(engine.step_seconds)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        events = engine.step()
        times.append(time.perf_counter() - t0)
        assert len(events) == batch, f"a decode step of {len(events)} rows, not {batch}"
    per_step = {k: (v - phases[k]) / args.steps for k, v in engine.step_seconds.items()}
    for i in range(batch):
        engine.abort(f"{batch}-{i}")
    assert not engine.has_unfinished and engine.blocks.num_used == 0
    return times, per_step


def replay_seconds(engine: LLMEngine, batch: int, n: int = 50) -> float:
    """The GPU's time for one replay of the graph a step of `batch` rows takes (CUDA events
    around n back-to-back replays): the forward pass without the host's work."""
    graphs = engine.runner.graphs
    assert graphs is not None
    rung = graphs.rung(batch)
    assert rung is not None
    graph = graphs.graphs[rung][0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def step_bytes(engine: LLMEngine, batch: int, context: int) -> int:
    """What one decode step must read: every weight once, and each row's KV."""
    model = engine.runner.model
    weights = sum(p.numel() * p.element_size()
                  for p in {id(p): p for p in model.parameters()}.values())
    pool = engine.runner.kv_pool  # [layers, 2, slots, K, D]
    per_token = pool.shape[0] * pool.shape[1] * pool[0, 0, 0].numel() * pool.element_size()
    return weights + batch * context * per_token


def bench_decode(args: argparse.Namespace, peak: float) -> list[dict[str, Any]]:
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        longest = args.prompt_tokens + args.steps + HEADROOM
        engine_dir = build(Path(tmp), args.dtype, max(batches), longest)
        blocks = max(batches) * -(-longest // BLOCK) + 64
        for graphs in (False, True):
            t0 = time.perf_counter()
            engine = LLMEngine.from_engine_dir(engine_dir, num_kv_blocks=blocks,
                                               placement=Placement("GPU", 0),
                                               cuda_graphs=graphs)
            print(f"[bench_gpu] engine loaded, graphs {'on' if graphs else 'off'}: "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            for batch in batches:
                decode_steps(engine, batch, args)  # warm-up: kernels compiled, allocator grown
                times, phases = decode_steps(engine, batch, args)
                ms = statistics.median(times) * 1e3
                moved = step_bytes(engine, batch, args.prompt_tokens + args.steps // 2)
                replay = replay_seconds(engine, batch) * 1e3 if graphs else None
                rows.append({"graphs": graphs, "batch": batch, "step_ms": ms,
                             "bytes": moved, "roofline_ms": moved / peak * 1e3,
                             "replay_ms": replay,
                             "phases_ms": {k: v * 1e3 for k, v in phases.items()}})
                print(f"[bench_gpu] graphs {'on ' if graphs else 'off'} batch {batch:3d}: "
                      f"{ms:7.3f} ms a step" + (f", replay alone {replay:.3f} ms"
                                                if replay is not None else ""), flush=True)
            if graphs:
                assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
            del engine
            torch.cuda.empty_cache()
    return rows


def _ipc_owner(conn: Any, shape: tuple[int, ...], dtype: torch.dtype, pulls: int) -> None:
    from python_backends.flag_board import FlagBoard
    from python_backends.kv_transfer.cuda_ipc import CudaIpcSource

    pool = torch.randn(shape, device="cuda").to(dtype)
    board = FlagBoard.create(size=pulls + 1)
    source = CudaIpcSource(pool)
    conn.send((board.name, [board.acquire() for _ in range(pulls)], source.location()))
    conn.recv()
    board.close()


def bench_ipc(args: argparse.Namespace) -> dict[str, float]:
    """A --ipc-tokens prompt's KV (the model's shape, --dtype) pulled device to device from
    another process: the first pull (maps the owner's allocation) and the median of the rest."""
    from python_backends.flag_board import BoardCache
    from python_backends.kv_transfer.base import KVHandle
    from python_backends.kv_transfer.cuda_ipc import CudaIpcSink
    from python_backends.kv_transfer.layout import KVLayout, allocate_pool

    n = -(-args.ipc_tokens // BLOCK)
    layout = KVLayout(num_layers=SHAPE["num_hidden_layers"],
                      num_kv_heads=SHAPE["num_key_value_heads"],
                      head_dim=SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
                      block_size=BLOCK, dtype=args.dtype, num_blocks=2 * n)
    dtype = getattr(torch, args.dtype)
    pulls = 6
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_owner, args=(child, layout.shape, dtype, pulls), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "the CUDA IPC owner sent nothing within 120 s"
        board, tickets, location = parent.recv()
        dst = allocate_pool(layout, device=torch.device("cuda"))
        boards = BoardCache()
        sink = CudaIpcSink(layout, dst, boards)
        blocks = list(range(n, 2 * n))[::-1]  # scattered the other way round
        seconds = []
        for ticket in tickets:
            handle = KVHandle("cuda_ipc", "owner", layout, tuple(range(n)), args.ipc_tokens,
                              time.time() + 60, board, ticket, location)
            t0 = time.perf_counter()
            moved = sink.pull(handle, blocks)
            seconds.append(time.perf_counter() - t0)
        parent.send("bye")
        proc.join(30)
        boards.close()
    finally:
        if proc.is_alive():
            proc.kill()
    return {"bytes": moved, "first_s": seconds[0], "median_s": statistics.median(seconds[1:])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--ipc-tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("[bench_gpu] error: needs CUDA", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    sheet = next((tbs for key, tbs in DATASHEET_TBS.items() if key in name), None)
    copied = copy_bandwidth()
    peak = sheet * 1e12 if sheet else copied
    print(f"[bench_gpu] {name}, torch {torch.__version__}; device copy {copied / 1e12:.2f} TB/s "
          f"(read + written); roofline at {peak / 1e12:.2f} TB/s "
          f"({'datasheet' if sheet else 'the copy'})", flush=True)
    rows = bench_decode(args, peak)
    print(f"\nDecode step, {args.dtype}, {args.prompt_tokens}-token prompts, median of "
          f"{args.steps} steps; roofline: (weights + KV read) / {peak / 1e12:.2f} TB/s")
    print("| batch | graphs off ms | graphs on ms | speed-up | bytes read (MB) | roofline ms |"
          " off: of roofline | on: of roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        off = next(r for r in rows if r["batch"] == batch and not r["graphs"])
        on = next(r for r in rows if r["batch"] == batch and r["graphs"])
        print(f"| {batch} | {off['step_ms']:.3f} | {on['step_ms']:.3f} | "
              f"{off['step_ms'] / on['step_ms']:.1f}x | {on['bytes'] / 1e6:.0f} | "
              f"{on['roofline_ms']:.3f} | {off['roofline_ms'] / off['step_ms']:.0%} | "
              f"{on['roofline_ms'] / on['step_ms']:.0%} |")
    print("\nGraphs on: the forward pass alone (one replay, GPU time) and the engine's step by "
          "phase (host time, ms a step; forward includes the replay and waiting for it)")
    phases = list(rows[0]["phases_ms"])
    print("| batch | replay ms | replay: of roofline | " + " | ".join(phases) + " |")
    print("|---|---|---|" + "---|" * len(phases))
    for on in (r for r in rows if r["graphs"]):
        print(f"| {on['batch']} | {on['replay_ms']:.3f} | "
              f"{on['roofline_ms'] / on['replay_ms']:.0%} | "
              + " | ".join(f"{on['phases_ms'][k]:.3f}" for k in phases) + " |")
    ipc = bench_ipc(args)
    print(f"\nCUDA IPC handoff between two processes, a {args.ipc_tokens}-token prompt's KV "
          f"({ipc['bytes'] / 1e6:.1f} MB, {args.dtype}): first pull {ipc['first_s'] * 1e3:.2f} ms "
          f"({ipc['bytes'] / ipc['first_s'] / 1e9:.1f} GB/s, maps the owner's pool), then "
          f"{ipc['median_s'] * 1e3:.3f} ms ({ipc['bytes'] / ipc['median_s'] / 1e9:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
