#!/usr/bin/env python3
"""Throughput and latency of the running server against Hugging Face greedy generate.

Drives `ensemble/generate_stream` with a fixed workload (N requests of P prompt tokens and
exactly O output tokens: end id ignored) at each concurrency level, and runs Hugging Face
transformers' batch-1 greedy `generate` on the same prompts in the same run as the baseline.

    python scripts/benchmark.py                      # against a server on 127.0.0.1:8000
    python scripts/benchmark.py --start-server       # starts one on free ports, then stops it
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from python_backends.bench.client import LLMClient, StreamResult, percentile
from python_backends.config import DEFAULT_ENGINE_DIR, EngineConfig
from python_backends.engine.builder import load_hf
from python_backends.ops.launcher import server_for

WORDS = ("river", "mountain", "lantern", "harbor", "meadow", "engine", "violet", "signal",
         "orchard", "copper", "thunder", "library")


def make_prompts(tokenizer: Any, n: int, prompt_tokens: int) -> list[str]:
    """n distinct prompts of about `prompt_tokens` tokens each."""
    prompts = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(prompt_tokens * 2)]
        text = f"Story {i}: " + " ".join(words)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


@dataclass
class Row:
    name: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    tpot_p50_ms: float
    tpot_p95_ms: float


def hf_baseline(engine_dir: Path, prompts: list[str], output_tokens: int) -> Row:
    config = EngineConfig.load(engine_dir)
    model, _ = load_hf(config.source)
    tokenizer = AutoTokenizer.from_pretrained(str(engine_dir))
    ttfts, tpots, total, t_all = [], [], 0, 0.0
    with torch.inference_mode():
        ids0 = torch.tensor([tokenizer(prompts[0])["input_ids"]])
        model.generate(ids0, max_new_tokens=2, do_sample=False)  # warm-up
        for p in prompts:
            ids = torch.tensor([tokenizer(p)["input_ids"]])
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=output_tokens, min_new_tokens=output_tokens,
                                 do_sample=False)
            dt = time.perf_counter() - t0
            n = out.shape[1] - ids.shape[1]
            total += n
            t_all += dt
            ttfts.append(ttft)
            tpots.append((dt - ttft) / max(1, n - 1))
    return Row("hf-generate", 1, len(prompts), total, t_all, total / t_all,
               percentile(ttfts, 0.5) * 1e3, percentile(ttfts, 0.95) * 1e3,
               percentile(tpots, 0.5) * 1e3, percentile(tpots, 0.95) * 1e3)


def run_level(client: LLMClient, prompts: list[str], output_tokens: int, c: int) -> Row:
    def one(prompt: str) -> StreamResult:
        return client.stream_collect(prompt, max_tokens=output_tokens, end_id=-1,
                                     exclude_input_in_output=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        results = list(pool.map(one, prompts))
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in results)
    bad = [r for r in results if len(r.output_ids) != output_tokens]
    if bad:
        raise SystemExit(f"{len(bad)} requests returned the wrong number of tokens")
    ttfts = [r.ttft for r in results]
    tpots = [t for r in results if (t := r.tpot) is not None]
    return Row("server", c, len(results), tokens, seconds, tokens / seconds,
               percentile(ttfts, 0.5) * 1e3, percentile(ttfts, 0.95) * 1e3,
               percentile(tpots, 0.5) * 1e3, percentile(tpots, 0.95) * 1e3)


def print_table(rows: list[Row], baseline: Row) -> None:
    print(f"\n{'run':<12}{'conc':>5}{'reqs':>6}{'out tok':>8}{'tok/s':>9}{'x HF':>7}"
          f"{'TTFT p50':>10}{'p95':>8}{'TPOT p50':>10}{'p95':>8}   (ms)")
    for r in [baseline, *rows]:
        ratio = r.tokens_per_s / baseline.tokens_per_s
        print(f"{r.name:<12}{r.concurrency:>5}{r.requests:>6}{r.output_tokens:>8}"
              f"{r.tokens_per_s:>9.1f}{ratio:>7.2f}{r.ttft_p50_ms:>10.0f}{r.ttft_p95_ms:>8.0f}"
              f"{r.tpot_p50_ms:>10.1f}{r.tpot_p95_ms:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--start-server", action="store_true", help="start a server on free ports")
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR)
    ap.add_argument("--num-requests", type=int, default=32, help="requests per level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--hf-requests", type=int, default=3, help="prompts for the HF baseline")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(str(args.engine))
    prompts = make_prompts(tokenizer, args.num_requests, args.prompt_tokens)

    print(f"[bench] HF transformers batch-1 greedy on {args.hf_requests} prompts ...", flush=True)
    baseline = hf_baseline(args.engine, prompts[: args.hf_requests], args.output_tokens)
    print(f"[bench] HF: {baseline.tokens_per_s:.1f} tok/s", flush=True)

    with server_for(args.start_server, args.url, "", args.engine,
                    Path("/tmp/benchmark-triton.log")) as (url, _metrics_url):
        client = LLMClient(url)
        client.stream_collect(prompts[0], max_tokens=4)  # warm-up
        rows = []
        for c in levels:
            print(f"[bench] server, concurrency {c}: {args.num_requests} requests x "
                  f"{args.output_tokens} tokens ...", flush=True)
            rows.append(run_level(client, prompts, args.output_tokens, c))
            print(f"[bench]   {rows[-1].tokens_per_s:.1f} tok/s", flush=True)
    print_table(rows, baseline)
    if args.json:
        args.json.write_text(json.dumps(
            {"baseline": asdict(baseline), "server": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
