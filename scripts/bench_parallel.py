#!/usr/bin/env python3
"""Per-step time of each parallel layout, split into compute and communication.

Builds a random-weight Llama (SmolLM2-like width, 4 KV heads so tp 1/2/4 all apply) and a
Mixtral of the same width (4 experts, top-2) as an engine per layout, runs the same batch through
each (one prefill step of --batch prompts, then --decode-steps decode steps), and prints per
step: wall time, and on rank 0 the time spent in the step broadcast, all-reduces, all-gathers
(LM head; MoE token shares), all-to-alls (MoE dispatch and combine) and stage-to-stage
send/recv (under pipeline parallelism rank 0 also waits there for the later stages: the
pipeline's bubble). Compute is the rest. Ratios are against the single-rank engine of the same
model, measured in the same run.

    python scripts/bench_parallel.py        # tp1 tp2 tp4 pp2 pp3 tp2-pp2 moe-ep1 moe-ep2 ...
    python scripts/bench_parallel.py --layouts tp1,tp2,moe-ep1,moe-ep2 --decode-steps 64

On a 2-core machine every extra rank shares the same cores, so the figures show each pattern's
overhead, not a speed-up. `--gpu`: rank r on GPU r, NCCL between them; layouts needing more
GPUs than are visible are left out (named).
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
from python_backends.parallel.context import COMM
from python_backends.parallel.placement import Placement
from python_backends.params import SamplingParams

KINDS = ("broadcast", "all_reduce", "all_gather", "all_to_all", "send_recv")
DEFAULT_LAYOUTS = "tp1,tp2,tp4,pp2,pp3,tp2-pp2,moe-ep1,moe-ep2,moe-ep4,moe-tp2-ep2"


def parse_layout(spec: str) -> tuple[bool, ParallelLayout]:
    """'tp2-pp2' -> (dense, tp=2 pp=2); 'moe-ep2' -> (mixture of experts, ep=2)."""
    parts = spec.split("-")
    moe = parts[0] == "moe"
    sizes = {p[:2]: int(p[2:]) for p in parts[moe:]}
    return moe, ParallelLayout(**sizes)


def build(root: Path, specs: list[str], args: argparse.Namespace) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    shape = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=args.layers,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                 tie_word_embeddings=True)
    models = {}
    torch.manual_seed(0)
    models[False] = LlamaForCausalLM(LlamaConfig(**shape, intermediate_size=1536)).eval()
    models[True] = MixtralForCausalLM(MixtralConfig(
        **shape, intermediate_size=768, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=None)).eval()
    limits = EngineLimits(max_seq_len=1024, max_num_seqs=64, max_num_batched_tokens=4096,
                          block_size=16)
    dirs = {}
    for spec in specs:
        moe, layout = parse_layout(spec)
        dirs[spec] = root / spec
        write_engine(models[moe], None, dirs[spec], limits, "float32", "random",
                     log=lambda _m: None, parallel=layout)
    return dirs


def measure(engine_dir: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    placement = Placement("GPU", 0) if args.gpu else Placement()
    engine = LLMEngine.from_engine_dir(engine_dir, num_kv_blocks=512, placement=placement)
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
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                    help="comma-separated: tpN, ppN, epN joined by '-', 'moe-' for the MoE model")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--gpu", action="store_true", help="run on GPUs (rank r on GPU r)")
    args = ap.parse_args(argv)
    specs = args.layouts.split(",")
    if args.gpu:
        visible = torch.cuda.device_count()
        too_big = [s for s in specs if parse_layout(s)[1].world_size > visible]
        if too_big:
            print(f"[bench_parallel] {visible} GPU(s) visible: leaving out {', '.join(too_big)}")
        specs = [s for s in specs if s not in too_big]
        if not specs:
            print("[bench_parallel] --gpu: no layout fits the visible GPUs", file=sys.stderr)
            return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[bench_parallel] building {len(specs)} engines ...", flush=True)
        dirs = build(Path(tmp), specs, args)
        for name, engine_dir in dirs.items():
            print(f"[bench_parallel] {name}: {args.batch} x {args.prompt_tokens}-token prompts, "
                  f"{args.decode_steps} decode steps ...", flush=True)
            results[name] = measure(engine_dir, args)
    for phase in ("prefill", "decode"):
        print(f"\n{phase + ' step, ms (median)':<26}" + "".join(f"{k:>11}" for k in
              ("wall", "compute", *KINDS)) + f"{'x 1 rank':>10}")
        for name, r in results.items():
            row = r[phase]
            base = results.get("moe-ep1" if parse_layout(name)[0] else "tp1")
            ratio = f"{row['wall'] / base[phase]['wall']:.2f}" if base else ""
            print(f"{name:<26}" + "".join(f"{1e3 * row[k]:>11.1f}" for k in
                  ("wall", "compute", *KINDS)) + f"{ratio:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
