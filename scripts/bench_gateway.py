#!/usr/bin/env python3
"""What the gateway adds to latency, measured in one run against Triton's own endpoint.

Starts a server and a gateway in front of it, then sends rounds of --concurrency concurrent
streaming requests (--max-tokens tokens each, greedy, the end token ignored) four ways,
interleaved round by round so that the machine's noise falls on all of them alike:

  direct    Triton's HTTP generate_stream (SSE)
  grpc      Triton's gRPC stream, the endpoint the gateway itself calls
  proxied   the gateway's generate_stream (SSE, through the gateway and gRPC)
  openai    the gateway's /v1/completions with stream: true

Printed per way: TTFT p50 and p95, and the mean time between streamed tokens (p50 over
requests); then the gateway's additions against Triton's endpoints, and the gateway's own CPU
time per streamed token (what it takes from the engines on a machine with few cores).

    python scripts/bench_gateway.py [--concurrency 32] [--max-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
import tritonclient.grpc as grpcclient

from python_backends.client import percentile
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.gateway.triton import ENSEMBLE, ensemble_inputs
from python_backends.launcher import ServerOptions, TritonServer, start_gateway, stop_process
from python_backends.net import free_port
from python_backends.procfs import cpu_seconds

PROMPT = "Write a long story about a lighthouse keeper and the sea. Chapter {i}:"
# one streamed request: (seconds to its first token, seconds between its tokens)
Sample = tuple[float, list[float]]


def sse_events(r: requests.Response) -> Iterator[dict[str, object]]:
    for line in r.iter_lines():
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            yield json.loads(line[5:])


def timed(events: Iterator[object], start: float) -> Sample:
    return sample([time.perf_counter() for _ in events], start)


def sample(times: list[float], start: float) -> Sample:
    """A stream whose events arrived at `times` (perf_counter), sent at `start`."""
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


def grpc_stream(address: str, max_tokens: int) -> Callable[[int], Sample]:
    """Triton's gRPC streaming endpoint, as the gateway calls it (one client per request)."""
    def one(i: int) -> Sample:
        events: queue.Queue[tuple[float, Any, Any]] = queue.Queue()
        client = grpcclient.InferenceServerClient(address)
        client.start_stream(callback=lambda result, error: events.put(
            (time.perf_counter(), result, error)))
        try:
            start = time.perf_counter()
            client.async_stream_infer(ENSEMBLE, ensemble_inputs({
                "text_input": PROMPT.format(i=i), "max_tokens": max_tokens, "stream": True,
                "end_id": -1}))
            times: list[float] = []
            while True:
                at, result, error = events.get(timeout=600)
                if error is not None:
                    raise RuntimeError(f"gRPC stream failed: {error}")
                times.append(at)
                if result.as_numpy("finish_reason").reshape(-1)[0]:
                    break
            return sample(times, start)
        finally:
            client.stop_stream()
            client.close()

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
                        "grpc": grpc_stream(opts.grpc_address, args.max_tokens),
                        "proxied": kserve(gw, args.max_tokens),
                        "openai": openai(gw, args.max_tokens)}
                results, cpu = measure(ways, args.concurrency, args.rounds,
                                       lambda: cpu_seconds(gateway.pid))
            finally:
                stop_process(gateway)
    report(results, cpu, args)
    return 0


def measure(ways: dict[str, Callable[[int], Sample]], concurrency: int, rounds: int,
            gateway_cpu: Callable[[], float]) -> tuple[dict[str, list[Sample]], dict[str, float]]:
    """Each way's samples, and the gateway's CPU seconds while each way ran."""
    for one in ways.values():  # warm-up: connections, the engine's first steps
        run_round(one, min(4, concurrency), 0)
    results: dict[str, list[Sample]] = {name: [] for name in ways}
    cpu = dict.fromkeys(ways, 0.0)
    for r in range(rounds):
        for name, one in ways.items():
            t0, c0 = time.monotonic(), gateway_cpu()
            results[name] += run_round(one, concurrency, r * concurrency)
            cpu[name] += gateway_cpu() - c0
            print(f"[bench] round {r + 1}/{rounds} {name:<8} {time.monotonic() - t0:5.1f} s",
                  flush=True)
    return results, cpu


def report(results: dict[str, list[Sample]], cpu: dict[str, float],
           args: argparse.Namespace) -> None:
    print(f"\nconcurrency {args.concurrency}, {args.max_tokens} tokens a request, "
          f"{args.rounds} rounds (interleaved)")
    print(f"{'way':<8} {'TTFT p50':>9} {'TTFT p95':>9} {'ms/token':>9} "
          f"{'gateway CPU ms/token':>21}")
    rows = {name: summary(samples) for name, samples in results.items()}
    for name, row in rows.items():
        tokens = sum(len(gaps) + 1 for _, gaps in results[name])
        print(f"{name:<8} {row['ttft_p50_ms']:>8.1f}  {row['ttft_p95_ms']:>8.1f}  "
              f"{row['itl_ms']:>8.2f}  {1000 * cpu[name] / tokens:>20.3f}")
    for base_name in ("grpc", "direct"):
        base = rows[base_name]
        for name in ("proxied", "openai"):
            row = rows[name]
            print(f"gateway ({name}) against Triton's {base_name:<6}: "
                  f"{row['ttft_p50_ms'] - base['ttft_p50_ms']:+7.1f} ms TTFT p50, "
                  f"{row['itl_ms'] - base['itl_ms']:+.2f} ms per token "
                  f"(x{row['ttft_p50_ms'] / base['ttft_p50_ms']:.2f} and "
                  f"x{row['itl_ms'] / base['itl_ms']:.2f})")


if __name__ == "__main__":
    sys.exit(main())
