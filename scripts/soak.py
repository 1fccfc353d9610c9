#!/usr/bin/env python3
"""A bounded soak on loopback: a server of its own at saturation under a fault schedule, every
request accounted for (see python_backends/bench/soak.py). Exits 1 when a request hung, an answer
differed from Hugging Face's, the server answered a 5xx, KV blocks stayed held, or (with
--max-memory-growth) a process grew past the bound.

    scripts/soak.py --duration 150                # the short run CI makes
    scripts/soak.py --duration 1800 --worker-tp 3 --max-memory-growth 5 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from python_backends.bench.soak import (
    FAULTS,
    LONG_PROMPTS,
    MAX_TOKENS,
    PROMPTS,
    RATE_LIMITS,
    Soak,
    SoakOptions,
    as_json,
    print_report,
)
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.engine.builder import hf_greedy, reshard_engine
from python_backends.ops.launcher import ServerOptions, TritonServer, free_port

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench-results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=150.0, help="seconds of load (150)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (8)")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated fault schedule, evenly spaced ({','.join(FAULTS)})")
    p.add_argument("--worker-tp", type=int, default=1,
                   help="serve the worker on this many tensor-parallel ranks (3 for SmolLM2), so "
                        "the rank fault has a rank to kill")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="client timeout: a request with no answer by then is hung (60)")
    p.add_argument("--max-memory-growth", type=float, default=None,
                   help="fail if a process's resident memory grew more than this %% after "
                        "warm-up (reported, not checked, by default)")
    p.add_argument("--warmup", type=float, default=30.0,
                   help="a process's size this long after it started is its baseline (30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-dir", type=Path, default=Path(DEFAULT_ENGINE_DIR))
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--log", type=Path, help="server log (default: a temporary file)")
    args = p.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS) - {""}
    if unknown:
        p.error(f"--faults: unknown {sorted(unknown)}; choose from {','.join(FAULTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.engine_dir / "config.json").is_file():
        print(f"no engine at {args.engine_dir}: run scripts/setup_env.sh first", file=sys.stderr)
        return 2
    print(f"[soak] Hugging Face reference for {len(PROMPTS) + len(LONG_PROMPTS)} prompts ...",
          flush=True)
    reference = hf_greedy(args.engine_dir, PROMPTS + LONG_PROMPTS, MAX_TOKENS)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        log = args.log or Path(tmp) / "server.log"
        opts = ServerOptions(http_port=free_port(), grpc_port=free_port(),
                             metrics_port=free_port(), engine_dir=args.engine_dir,
                             log_file=log, exit_timeout_s=30, fault_injection=True)
        print(f"[soak] starting a server on 127.0.0.1:{opts.http_port} (log: {log}) ...",
              flush=True)
        with TritonServer(opts) as triton:
            triton.wait_ready(timeout_s=600, progress=True)
            repo = opts.repository()  # a server of its own: its variants need no undoing
            repo.set_parameters("front", rate_limits=json.dumps(RATE_LIMITS))
            if args.worker_tp > 1:
                from python_backends.config import ParallelLayout

                engine = Path(tmp) / f"tp{args.worker_tp}"
                reshard_engine(args.engine_dir, engine, ParallelLayout(tp=args.worker_tp),
                               log=print)
                repo.set_parameters("worker", engine_dir=str(engine))
            faults = tuple(f for f in args.faults.split(",") if f)
            print(f"[soak] {args.duration:.0f} s, {args.clients} clients, faults: "
                  f"{', '.join(faults) or 'none'}", flush=True)
            soak = Soak(triton, reference, SoakOptions(
                duration_s=args.duration, clients=args.clients,
                request_timeout_s=args.request_timeout, faults=faults, seed=args.seed,
                warmup_s=args.warmup))
            t0 = time.monotonic()
            report = soak.run()
            print(f"[soak] done in {time.monotonic() - t0:.0f} s", flush=True)
            if report["server_died"]:
                print(f"[soak] tritonserver died; the end of its log ({log}):",
                      *log.read_text(errors="replace").splitlines()[-80:], sep="\n  ",
                      flush=True)
        if args.max_memory_growth is not None:
            grown = [r for r in report["memory"]
                     if r["growth_pct"] > args.max_memory_growth and not r["exited"]]
            report["memory_ok"] = not grown
            report["ok"] = report["ok"] and not grown
        if not report["ok"] and args.log is None:  # a failed run keeps its server log
            kept = RESULTS_DIR / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.log"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, kept)
            report["server_log"] = str(kept)
    print_report(report)
    if args.json:
        args.json.write_text(as_json(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
