#!/usr/bin/env python3
"""Concurrency sweep with aiperf: a results table (JSON, CSV) and PNG plots.

Drives `ensemble/generate_stream` with aiperf (template endpoint, see docs/platform.md) on a fixed
workload (--prompt-tokens, --output-tokens with the end id ignored) at each --concurrency, and
optionally a peer OpenAI-compatible server (for example vLLM for CPU, started by you) with the
same aiperf workload in the same run, then prints each level's figures and the ratios to the
peer. For our server it also reads the server's own TTFT histogram over each level and prints
it against aiperf's (they measure the same thing from two ends).

aiperf runs from its own environment, `.venv-aiperf`, which scripts/test.sh creates (see
python_backends/aiperf.py).

    python scripts/bench_sweep.py --start-server --out-dir bench-results
    python scripts/bench_sweep.py --peer-url http://127.0.0.1:8100 --peer-model SmolLM2
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from python_backends.aiperf import AiperfError, Target, find_aiperf, profile
from python_backends.client import histogram_mean, scrape
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.launcher import server_for

# (aiperf's JSON key, our column)
FIELDS = [
    ("request_throughput", "requests_per_s"),
    ("output_token_throughput", "output_tokens_per_s"),
    ("time_to_first_token", "ttft"),
    ("inter_token_latency", "itl"),
    ("request_latency", "e2e"),
]


def row_of(name: str, c: int, result: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"target": name, "concurrency": c}
    for key, col in FIELDS:
        stats = result.get(key, {})
        if col.endswith("_per_s"):
            row[col] = stats.get("avg")
        else:
            for q in ("avg", "p50", "p95"):
                row[f"{col}_{q}_ms"] = stats.get(q)
    return row


def server_ttft_mean_ms(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    mean = histogram_mean(before, after, "llm_time_to_first_token_seconds")
    return None if mean is None else 1e3 * mean


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[sweep] matplotlib not installed: no plots", flush=True)
        return []
    paths = []
    targets = sorted({r["target"] for r in rows})
    charts = [("throughput.png", [("output_tokens_per_s", "output tokens/s")]),
              ("ttft.png", [("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p95_ms", "TTFT p95 (ms)")]),
              ("itl.png", [("itl_p50_ms", "ITL p50 (ms)"), ("itl_p95_ms", "ITL p95 (ms)")])]
    for filename, series in charts:
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in targets:
            mine = [r for r in rows if r["target"] == target]
            for col, label in series:
                ax.plot([r["concurrency"] for r in mine], [r[col] for r in mine], marker="o",
                        label=f"{target} {label}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    ap.add_argument("--start-server", action="store_true", help="start a server on free ports")
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR, help="also the tokenizer")
    ap.add_argument("--aiperf", default=None, help="aiperf executable")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16, help="per level, at least 2x concurrency")
    ap.add_argument("--peer-url", default=None, help="an OpenAI-compatible server to compare")
    ap.add_argument("--peer-model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--peer-endpoint", default="completions", choices=("completions", "chat"))
    ap.add_argument("--peer-ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="send ignore_eos to the peer (vLLM); --no-peer-ignore-eos for servers "
                    "that refuse it (configure them without an end token instead)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per aiperf run")
    args = ap.parse_args(argv)
    aiperf = find_aiperf(args.aiperf)
    if aiperf is None:
        raise SystemExit("aiperf not found: run scripts/test.sh once (it creates .venv-aiperf), "
                         "or pass --aiperf PATH")
    levels = [int(c) for c in args.concurrency.split(",")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, server_for(
            args.start_server, args.url, args.metrics_url, args.engine,
            Path("/tmp/bench-sweep-triton.log")) as (url, metrics_url):
        ours = Target.ours(url, Path(tmp))
        targets = [ours]
        if args.peer_url:
            targets.append(Target.openai(args.peer_url, args.peer_model, args.peer_endpoint,
                                         ignore_eos=args.peer_ignore_eos))
        for target in targets:
            for c in levels:
                n = max(args.requests, 2 * c)
                print(f"[sweep] {target.name} concurrency {c}: {n} requests ...", flush=True)
                before = scrape(metrics_url) if target is ours else {}
                try:
                    result = profile(aiperf, target, concurrency=c, requests=n,
                                     prompt_tokens=args.prompt_tokens,
                                     output_tokens=args.output_tokens, tokenizer=args.engine,
                                     artifacts=Path(tmp) / f"{target.name}-c{c}",
                                     timeout_s=args.timeout)
                except AiperfError as e:
                    raise SystemExit(str(e)) from e
                row = row_of(target.name, c, result)
                if target is ours:
                    row["server_ttft_avg_ms"] = server_ttft_mean_ms(before,
                                                                    scrape(metrics_url))
                rows.append(row)
                print(f"[sweep]   {row['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                      f"{row['ttft_p50_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms",
                      flush=True)
    (args.out_dir / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    with (args.out_dir / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r},
                                                     key=lambda k: (k != "target", k)))
        writer.writeheader()
        writer.writerows(rows)
    plots = plot(rows, args.out_dir)
    print(f"\n{'target':<12}{'conc':>5}{'tok/s':>9}{'TTFT p50':>10}{'p95':>8}{'ITL p50':>9}"
          f"{'p95':>7}{'server TTFT/aiperf':>20}   (ms)")
    for r in rows:
        ratio = ""
        if r.get("server_ttft_avg_ms") and r.get("ttft_avg_ms"):
            ratio = f"{r['server_ttft_avg_ms'] / r['ttft_avg_ms']:.2f}"
        print(f"{r['target']:<12}{r['concurrency']:>5}{r['output_tokens_per_s']:>9.1f}"
              f"{r['ttft_p50_ms']:>10.0f}{r['ttft_p95_ms']:>8.0f}{r['itl_p50_ms']:>9.1f}"
              f"{r['itl_p95_ms']:>7.1f}{ratio:>20}")
    peer = {r["concurrency"]: r for r in rows if r["target"] == "peer"}
    for r in rows:
        if r["target"] != "peer" and r["concurrency"] in peer:
            p = peer[r["concurrency"]]
            speed = r["output_tokens_per_s"] / p["output_tokens_per_s"]
            print(f"c={r['concurrency']}: throughput x{speed:.2f} of the peer, "
                  f"TTFT p50 x{r['ttft_p50_ms'] / p['ttft_p50_ms']:.2f}")
    print(f"\nwrote {args.out_dir / 'results.json'}, {args.out_dir / 'results.csv'}"
          + "".join(f", {p}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
