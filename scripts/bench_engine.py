#!/usr/bin/env python3
"""The engine driven alone against the fastest any server could be on this machine (a roofline).

    python scripts/bench_engine.py                                 # the default engine
    python scripts/bench_engine.py --engine engines/smollm2-bf16 --concurrency 1,8,32
    python scripts/bench_engine.py --peer 1=43.0,8=160.3,32=220.2 --peer-itl-ms 20.9

For each concurrency level it serves `--requests` random prompts of `--prompt-tokens` tokens to
exactly `--output-tokens` tokens each in this process (no server, no client: what the serving
path could keep at best), and prints that beside the roofline of python_backends.bench.roofline:
the larger of the level's arithmetic at the rate the engine's projections reach on prompt-sized
batches, and its minimum number of steps times the time one token takes through every projection
(a step's weight reads), on one core and on every core; and the tighter step bound
(roofline.step_bound): the decode rows' projections at the rate measured on as many rows as the
level has sequences, plus decode attention at its measured time per context slot with the KV
read from memory. `--peer` takes a peer server's output tokens/s per level (from
`scripts/bench_sweep.py --peer vllm`, same workload) and prints whether twice that is within the
step bound (the plain one where the model has no step bound: latent attention, sliding windows);
`--peer-itl-ms` the same for half the peer's time between tokens at concurrency 1. Engine
threads as in serving (`--threads`, 0: every core but one). Dense, single-rank engines
(float32, bfloat16, int8 weights); others are refused with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from python_backends.bench.roofline import (
    Projections,
    Workload,
    bound,
    drive,
    measure,
    measure_step,
    random_prompts,
    step_bound,
    summary,
)
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.engine.llm_engine import LLMEngine


def parse_levels(text: str) -> dict[int, float]:
    """"1=43,8=160" -> {1: 43.0, 8: 160.0}."""
    out = {}
    for part in filter(None, text.split(",")):
        level, _, value = part.partition("=")
        out[int(level)] = float(value)
    return out


def kernel_choice(engine: LLMEngine) -> str:
    model = engine.runner.model
    if model.native_linears:
        return "the native kernel with its idle-CPU helper (rates measured without the helper)"
    return f"one-token steps read the {'plain' if model.one_token_plain else 'packed'} weights"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=32, help="requests per level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="engine threads (0: cores - 1)")
    ap.add_argument("--peer", type=parse_levels, default={},
                    help="a peer's output tok/s per level: 1=43,8=160,32=220")
    ap.add_argument("--peer-itl-ms", type=float, default=None,
                    help="the peer's time between tokens at concurrency 1 (ms)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    cores = os.cpu_count() or 1

    start = time.perf_counter()
    engine = LLMEngine.from_engine_dir(args.engine, num_kv_blocks=4096,
                                       enable_prefix_caching=False, cpu_threads=args.threads)
    config = engine.config
    kind = config.dtype + (f", {config.weights} weights" if config.weights else "")
    projections = Projections.of(engine.runner.model)
    print(f"[engine] {args.engine} ({kind}) on {torch.get_num_threads()} thread(s) of {cores} "
          f"cores, loaded in {time.perf_counter() - start:.0f} s", flush=True)
    rates = measure(projections)
    print(f"[roofline] projections: {projections.weight_bytes / 1e6:.0f} MB of weights, "
          f"{projections.flops_per_token / 1e6:.0f} MFLOP per token + "
          f"{projections.lm_head_flops / 1e6:.0f} for the LM head; {kernel_choice(engine)}",
          flush=True)
    print(f"[roofline] one token through them: {rates.step_read_s * 1e3:.1f} ms "
          f"({projections.weight_bytes / rates.step_read_s / 1e9:.1f} GB/s); "
          f"{rates.prompt_rows} tokens at once: {rates.flops_per_s / 1e9:.0f} GFLOP/s", flush=True)
    if rates.fma_peak_flops_per_s:
        threads = torch.get_num_threads()
        print(f"[roofline] one thread's float32 FMA peak, measured: "
              f"{rates.fma_peak_flops_per_s / 1e9:.0f} GFLOP/s; the projections at "
              f"{rates.flops_per_s / (threads * rates.fma_peak_flops_per_s):.0%} of "
              f"{threads} thread(s)' peak", flush=True)

    # First steps of new batch shapes are slow (oneDNN picks kernels): warm up outside the levels.
    warm = Workload(args.prompt_tokens, 4, max(levels), max(levels))
    drive(engine, random_prompts(warm.requests, args.prompt_tokens, config.model.vocab_size,
                                 seed=1), warm)
    rows = []
    core_counts = sorted({1, cores})
    for level in levels:
        workload = Workload(args.prompt_tokens, args.output_tokens, level,
                            max(args.requests, level))
        prompts = random_prompts(workload.requests, args.prompt_tokens,
                                 config.model.vocab_size, seed=100 + level)
        driven = drive(engine, prompts, workload)
        bounds = [bound(workload, projections, rates, n) for n in core_counts]
        try:
            step = measure_step(engine, projections, level, workload.mean_decode_context)
        except ValueError as e:
            print(f"[roofline] no step bound: {e}")
            step = None
        steps = ([step_bound(workload, projections, rates, step, n) for n in core_counts]
                 if step is not None else [])
        row = summary(workload, driven, bounds, steps)
        row["phases_ms_per_token"] = {k: 1e3 * v / driven.output_tokens
                                      for k, v in driven.phases.items()}
        rows.append(row)
        phases = " ".join(f"{k} {v:.2f}" for k, v in row["phases_ms_per_token"].items() if v)
        print(f"\nconcurrency {level}: engine alone {driven.tokens_per_s:.1f} tok/s "
              f"({driven.ms_per_step:.1f} ms/step; ms per token: {phases})")
        for b in bounds:
            print(f"  bound on {b.cores} core(s): {b.tokens_per_s:.1f} tok/s "
                  f"(limit: {b.limit}; arithmetic {b.compute_s:.1f} s, "
                  f"weight reads {b.read_s:.1f} s); engine alone at "
                  f"{driven.tokens_per_s / b.tokens_per_s:.0%} of it")
        if step is not None:
            print(f"  a decode step of {level} rows: projections at "
                  f"{step.body_flops_per_s / 1e9:.0f} GFLOP/s, attention over "
                  f"{workload.mean_decode_context}-token contexts "
                  f"{step.attention_s_per_slot * 1e9:.1f} ns a slot (every layer, from memory)")
        for b in steps:
            print(f"  step bound on {b.cores} core(s): {b.tokens_per_s:.1f} tok/s (arithmetic "
                  f"{b.compute_s:.1f} s, decode attention {b.attention_s:.1f} s); engine alone "
                  f"at {driven.tokens_per_s / b.tokens_per_s:.0%} of it")
        if level in args.peer:
            need = 2 * args.peer[level]
            best = (steps or bounds)[-1].tokens_per_s
            verdict = "within" if need <= best else "beyond"
            print(f"  twice the peer ({args.peer[level]:.1f} tok/s) is {need:.1f} tok/s: "
                  f"{verdict} the {'step ' if steps else ''}bound on {bounds[-1].cores} "
                  f"core(s) ({best:.1f})")
            row["twice_peer_within_bound"] = need <= best
    if args.peer_itl_ms is not None:
        half = args.peer_itl_ms / 2
        floor = rates.min_step_s(cores) * 1e3
        verdict = "within" if half >= floor else "beyond"
        print(f"\nhalf the peer's time between tokens at concurrency 1 is {half:.1f} ms: "
              f"{verdict} the shortest step on {cores} core(s) ({floor:.1f} ms)")
    engine.close()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "engine": str(args.engine), "kind": kind, "threads": torch.get_num_threads(),
            "cores": cores, "weight_bytes": projections.weight_bytes,
            "flops_per_s": rates.flops_per_s, "step_read_s": rates.step_read_s,
            "fma_peak_flops_per_s": rates.fma_peak_flops_per_s,
            "levels": rows,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
