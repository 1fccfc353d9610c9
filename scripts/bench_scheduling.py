#!/usr/bin/env python3
"""Scheduling policies measured on the engine itself (no server in the way), in one run:

1. Chunked prefill: TPOT p95 of running decode streams while long prompts arrive, with the
   step budget splitting them into chunks vs computing each prompt in one step.
2. Priority: TTFT of a high-priority request on an engine saturated by low-priority streams
   (batch full) vs its TTFT on an idle engine.

    python scripts/bench_scheduling.py [--engine engines/smollm2] [--long-prompt 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from python_backends.bench.client import percentile
from python_backends.config import DEFAULT_ENGINE_DIR, EngineConfig, EngineLimits
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.loader import load_model
from python_backends.engine.waiting_queue import PriorityFairQueue
from python_backends.models.decoder import CausalLM
from python_backends.params import SamplingParams


def make_engine(config: EngineConfig, model: CausalLM, limits: EngineLimits,
                chunked: bool) -> LLMEngine:
    cfg = dataclasses.replace(config, limits=limits)
    return LLMEngine(cfg, model, num_kv_blocks=1024, enable_chunked_prefill=chunked,
                     waiting=PriorityFairQueue())


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 131 + j * 7) % 40000 + 100 for j in range(n)]


def chunked_prefill(config: EngineConfig, model: CausalLM, long_prompt: int,
                    budget: int, chunked: bool) -> list[float]:
    """Inter-token gaps of 4 decode streams while 3 long prompts arrive one by one."""
    # Unchunked, the budget must hold a whole prompt beside the decodes.
    limits = EngineLimits(max_seq_len=long_prompt + 256, max_num_seqs=16,
                          max_num_batched_tokens=budget if chunked else long_prompt + 64,
                          block_size=config.limits.block_size)
    engine = make_engine(config, model, limits, chunked)
    for i in range(4):
        engine.add_request(f"d{i}", prompt(32, i), SamplingParams(max_tokens=10_000, end_ids=()))
    last: dict[str, float] = {}
    gaps: list[float] = []
    arrivals = 0
    step = 0
    while arrivals < 3 or any(s.seq_id.startswith("p") for s in engine.scheduler.running):
        if step % 8 == 4 and arrivals < 3:
            engine.add_request(f"p{arrivals}", prompt(long_prompt, 100 + arrivals),
                               SamplingParams(max_tokens=1, end_ids=()))
            arrivals += 1
        for ev in engine.step():
            now = time.perf_counter()
            if ev.seq_id.startswith("d"):
                if ev.seq_id in last:
                    gaps.append(now - last[ev.seq_id])
                last[ev.seq_id] = now
        step += 1
    return gaps


def priority_ttft(config: EngineConfig, model: CausalLM, busy: bool) -> float:
    limits = EngineLimits(max_seq_len=1024, max_num_seqs=8, max_num_batched_tokens=1024,
                          block_size=config.limits.block_size)
    engine = make_engine(config, model, limits, chunked=True)
    if busy:
        for i in range(8):  # fills the batch: low-priority streams that never end on their own
            engine.add_request(f"low{i}", prompt(64, i), SamplingParams(max_tokens=900,
                               end_ids=()), priority=0)
        for _ in range(3):
            engine.step()
        for i in range(8, 16):  # and a queue of more low-priority work behind them
            engine.add_request(f"low{i}", prompt(64, i), SamplingParams(max_tokens=900,
                               end_ids=()), priority=0)
    t0 = time.perf_counter()
    engine.add_request("high", prompt(128, 99), SamplingParams(max_tokens=4, end_ids=()),
                       priority=9)
    while True:
        if any(ev.seq_id == "high" for ev in engine.step()):
            return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR)
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--chunk-budget", type=int, default=256)
    args = ap.parse_args(argv)
    config = EngineConfig.load(args.engine)
    model = load_model(args.engine, config)

    print(f"[sched] chunked prefill: 4 decode streams, 3 prompts of {args.long_prompt} tokens",
          flush=True)
    off = chunked_prefill(config, model, args.long_prompt, args.chunk_budget, chunked=False)
    on = chunked_prefill(config, model, args.long_prompt, args.chunk_budget, chunked=True)
    p95_off, p95_on = percentile(off, 0.95) * 1e3, percentile(on, 0.95) * 1e3
    print(f"  TPOT p95 without chunking  {p95_off:8.1f} ms   (p50 {percentile(off, .5)*1e3:.1f})")
    print(f"  TPOT p95 with chunks of {args.chunk_budget:<4} {p95_on:8.1f} ms   "
          f"(p50 {percentile(on, .5)*1e3:.1f})")
    print(f"  improvement: {p95_off / p95_on:.2f}x")

    print("[sched] priority: TTFT of a priority-9 request, 128-token prompt", flush=True)
    idle = min(priority_ttft(config, model, busy=False) for _ in range(2))
    busy = priority_ttft(config, model, busy=True)
    print(f"  idle engine                 {idle * 1e3:8.1f} ms")
    print(f"  saturated by priority 0     {busy * 1e3:8.1f} ms   ({busy / idle:.2f}x idle)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
