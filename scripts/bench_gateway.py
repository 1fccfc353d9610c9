#!/usr/bin/env python3
"""What the gateway adds to latency, measured in one run against Triton's own endpoint.

Starts a server (or uses --url/--grpc-port/--metrics-url of a running one) and a gateway in
front of it, then sends rounds of --concurrency concurrent streaming requests (--max-tokens
tokens each, greedy, the end token ignored) three ways, interleaved round by round so that the
machine's noise falls on all three alike:

  direct    Triton's HTTP generate_stream (SSE)
  proxied   the gateway's generate_stream (the same SSE, through the gateway and gRPC)
  openai    the gateway's /v1/completions with stream: true

Printed per way: TTFT p50 and p95, and the mean time between streamed tokens (p50 over
requests); then the gateway's additions against `direct`.

    python scripts/bench_gateway.py [--concurrency 32] [--max-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from python_backends.client import percentile
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.launcher import ServerOptions, TritonServer, start_gateway, stop_process
from python_backends.net import free_port

PROMPT = "Write a long story about a lighthouse keeper and the sea. Chapter {i}:"
# one streamed request: (seconds to its first token, seconds between its tokens)
Sample = tuple[float, list[float]]


def sse_events(r: requests.Response) -> Iterator[dict[str, object]]:
    for line in r.iter_lines():
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            yield json.loads(line[5:])


def timed(events: Iterator[object], start: float) -> Sample:
    times = [time.perf_counter() for _ in events]
    if not times:
        raise RuntimeError("the stream sent nothing")
    return times[0] - start, [b - a for a, b in itertools.pairwise(times)]


def kserve(url: str, max_tokens: int) -> Callable[[int], Sample]:
    def one(i: int) -> Sample:
        body: dict[str, Any] = {"text_input": PROMPT.format(i=i), "max_tokens": max_tokens,
                                "stream": True, "end_id": -1}
        start = time.perf_counter()
        with requests.post(f"{url}/v2/models/ensemble/generate_stream", json=body,
                           stream=True, timeout=600) as r:
            r.raise_for_status()
            return timed(sse_events(r), start)

    return one


def openai(url: str, max_tokens: int) -> Callable[[int], Sample]:
    def one(i: int) -> Sample:
        # OpenAI has no end_id: the prompt asks for a long answer
        body: dict[str, Any] = {"model": "smollm2", "prompt": PROMPT.format(i=i),
                                "max_tokens": max_tokens, "temperature": 0, "stream": True}
        start = time.perf_counter()
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as r:
            r.raise_for_status()
            return timed(sse_events(r), start)

    return one


def run_round(one: Callable[[int], Sample], concurrency: int, offset: int) -> list[Sample]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(offset, offset + concurrency)))


def summary(samples: list[Sample]) -> dict[str, float]:
    ttfts = [s[0] for s in samples]
    gaps = [statistics.mean(s[1]) for s in samples if s[1]]
    return {"ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
            "ttft_p95_ms": 1000 * percentile(ttfts, 0.95),
            "itl_ms": 1000 * statistics.median(gaps) if gaps else float("nan")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engine", type=Path, default=Path(DEFAULT_ENGINE_DIR))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        opts = ServerOptions(http_port=free_port(), grpc_port=free_port(),
                             metrics_port=free_port(), engine_dir=args.engine,
                             log_file=Path(tmp) / "server.log")
        with TritonServer(opts) as server:
            server.wait_ready(timeout_s=600, progress=True)
            port = free_port()
            gateway = start_gateway(opts, port)
            try:
                gw = f"http://127.0.0.1:{port}"
                ways = {"direct": kserve(opts.http_url, args.max_tokens),
                        "proxied": kserve(gw, args.max_tokens),
                        "openai": openai(gw, args.max_tokens)}
                results = measure(ways, args.concurrency, args.rounds)
            finally:
                stop_process(gateway)
    report(results, args)
    return 0


def measure(ways: dict[str, Callable[[int], Sample]], concurrency: int,
            rounds: int) -> dict[str, list[Sample]]:
    for one in ways.values():  # warm-up: connections, the engine's first steps
        run_round(one, min(4, concurrency), 0)
    results: dict[str, list[Sample]] = {name: [] for name in ways}
    for r in range(rounds):
        for name, one in ways.items():
            t0 = time.monotonic()
            results[name] += run_round(one, concurrency, r * concurrency)
            print(f"[bench] round {r + 1}/{rounds} {name:<8} {time.monotonic() - t0:5.1f} s",
                  flush=True)
    return results


def report(results: dict[str, list[Sample]], args: argparse.Namespace) -> None:
    print(f"\nconcurrency {args.concurrency}, {args.max_tokens} tokens a request, "
          f"{args.rounds} rounds (interleaved)")
    print(f"{'way':<8} {'TTFT p50':>9} {'TTFT p95':>9} {'ms/token':>9}")
    rows = {name: summary(samples) for name, samples in results.items()}
    for name, row in rows.items():
        print(f"{name:<8} {row['ttft_p50_ms']:>8.1f}  {row['ttft_p95_ms']:>8.1f}  "
              f"{row['itl_ms']:>8.2f}")
    base = rows["direct"]
    for name in ("proxied", "openai"):
        row = rows[name]
        print(f"gateway ({name}) adds {row['ttft_p50_ms'] - base['ttft_p50_ms']:+.1f} ms to "
              f"TTFT p50 and {row['itl_ms'] - base['itl_ms']:+.2f} ms per token "
              f"(x{row['ttft_p50_ms'] / base['ttft_p50_ms']:.2f} and "
              f"x{row['itl_ms'] / base['itl_ms']:.2f})")


if __name__ == "__main__":
    sys.exit(main())
