#!/usr/bin/env python3
"""Per-step time of each parallel layout, split into compute and communication.

Builds one random-weight Llama (SmolLM2-like width, 4 KV heads so tp 1/2/4 all apply) as an
engine per layout, runs the same batch through each (one prefill step of --batch prompts, then
--decode-steps decode steps), and prints per step: wall time, and on rank 0 the time spent in
the step broadcast, all-reduces, the LM head's all-gather, and stage-to-stage send/recv (under
pipeline parallelism rank 0 also waits there for the later stages: the pipeline's bubble).
Compute is the rest. Ratios are against tp=1 pp=1 measured in the same run.

    python scripts/bench_parallel.py                    # layouts 1x1 2x1 4x1 1x2 1x3 2x2 (tp x pp)
    python scripts/bench_parallel.py --layouts 1x1,2x1 --decode-steps 64

On a 2-core machine every extra rank shares the same cores, so the figures show each pattern's
overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from python_backends.config import EngineLimits, ParallelLayout
from python_backends.engine.builder import write_engine
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.sequence import SamplingParams
from python_backends.parallel.context import COMM

KINDS = ("broadcast", "all_reduce", "all_gather", "send_recv")


def build(root: Path, layouts: list[ParallelLayout], args: argparse.Namespace) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=2048, tie_word_embeddings=True)).eval()
    limits = EngineLimits(max_seq_len=1024, max_num_seqs=64, max_num_batched_tokens=4096,
                          block_size=16)
    dirs = {}
    for layout in layouts:
        name = f"tp{layout.tp}-pp{layout.pp}"
        dirs[name] = root / name
        write_engine(hf, None, dirs[name], limits, "float32", "random", log=lambda _m: None,
                     parallel=layout)
    return dirs


def measure(engine_dir: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    engine = LLMEngine.from_engine_dir(engine_dir, num_kv_blocks=512)
    try:
        g = torch.Generator().manual_seed(1)
        for i in range(args.batch):
            engine.add_request(str(i), torch.randint(1, 49152, (args.prompt_tokens,),
                                                     generator=g).tolist(),
                               SamplingParams(max_tokens=args.decode_steps + 1))
        COMM.enabled = True
        phases: dict[str, list[tuple[float, dict[str, float]]]] = {"prefill": [], "decode": []}
        while engine.has_unfinished:
            COMM.take()
            start = time.perf_counter()
            events = engine.step()
            wall = time.perf_counter() - start
            phase = "prefill" if any(e.num_output_tokens == 1 for e in events) else "decode"
            phases[phase].append((wall, COMM.take()))
        COMM.enabled = False
    finally:
        engine.close()
    out = {}
    for phase, steps in phases.items():
        steps = steps[1:] if phase == "decode" and len(steps) > 2 else steps  # first is warm-up
        row = {"wall": statistics.median(w for w, _ in steps)}
        for kind in KINDS:
            row[kind] = statistics.median(c.get(kind, 0.0) for _, c in steps)
        row["compute"] = row["wall"] - sum(row[k] for k in KINDS)
        out[phase] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layouts", default="1x1,2x1,4x1,1x2,1x3,2x2", help="tp x pp, comma-separated")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=24)
    args = ap.parse_args(argv)
    layouts = []
    for spec in args.layouts.split(","):
        tp, pp = (int(x) for x in spec.split("x"))
        layouts.append(ParallelLayout(tp=tp, pp=pp))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[bench_parallel] building {len(layouts)} engines ...", flush=True)
        dirs = build(Path(tmp), layouts, args)
        for name, engine_dir in dirs.items():
            print(f"[bench_parallel] {name}: {args.batch} x {args.prompt_tokens}-token prompts, "
                  f"{args.decode_steps} decode steps ...", flush=True)
            results[name] = measure(engine_dir, args)
    base = results.get("tp1-pp1")
    for phase in ("prefill", "decode"):
        print(f"\n{phase} step, ms (median){'':>4}" + "".join(f"{k:>12}" for k in
              ("wall", "compute", *KINDS)) + f"{'x tp1-pp1':>11}")
        for name, r in results.items():
            row = r[phase]
            ratio = f"{row['wall'] / base[phase]['wall']:.2f}" if base else ""
            print(f"{name:<26}" + "".join(f"{1e3 * row[k]:>12.1f}" for k in
                  ("wall", "compute", *KINDS)) + f"{ratio:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
