#!/usr/bin/env python3
"""Scheduling policies measured through a running Triton server, in one run.

Starts a server (explicit model control) and, for each measurement, reloads the `worker` model
onto a variant of the engine (same weights, hard-linked; only the serving limits differ):

1. Priority: TTFT of a priority-9 request (128-token prompt) with the worker's batch full of
   priority-0 streams and more queued, against its TTFT on the idle server (batch of 8).
2. Chunked prefill: inter-token gaps (TPOT) of 4 running streams while 3 prompts of
   --long-prompt tokens arrive, with chunked prefill (a --chunk-budget token step budget) and
   without (each prompt in one step).
3. Fairness: tenants A and B both backlogged, A sending 10x more requests than B (200 and 20
   streams, all at once; the batch holds 8); each tenant's share of the tokens generated while
   both are backlogged, with equal weights and with weights 3:1 (the worker's `tenant_weights`).

    python scripts/bench_scheduling_server.py [--engine engines/smollm2]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from python_backends.bench.client import LLMClient, percentile
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.engine.builder import engine_variant
from python_backends.net import free_port
from python_backends.ops.launcher import ServerOptions, TritonServer
from python_backends.ops.repository import TritonRepository

WORD = " hello"  # one token per repetition in SmolLM2's tokenizer


def worker_on(repo: TritonRepository, engine: Path, **params: str) -> Any:
    """The worker serving `engine` (and these parameters) until the block ends."""
    return repo.reloaded("worker", engine_dir=str(engine), **params)


class Streams:
    """Background streaming requests; records each token's arrival time per request."""

    def __init__(self, client: LLMClient, max_streams: int = 256) -> None:
        self.client = client
        self.stop = threading.Event()
        self.times: dict[str, list[float]] = {}
        self.pool = ThreadPoolExecutor(max_workers=max_streams)

    def start(self, name: str, prompt: str, max_tokens: int, **params: Any) -> None:
        """Every request goes to the worker (`route` aggregated): the policies measured here
        are the worker engine's, and long prompts would otherwise go to the prefill group."""
        params.setdefault("route", "aggregated")
        self.times[name] = []
        self.pool.submit(self._run, name, prompt, max_tokens, params)

    def _run(self, name: str, prompt: str, max_tokens: int, params: dict[str, Any]) -> None:
        try:
            for _ in self.client.stream(prompt, max_tokens=max_tokens, end_id=-1, **params):
                self.times[name].append(time.monotonic())
                if self.stop.is_set():
                    return  # closing the stream cancels the request
        except Exception as e:
            print(f"[sched] {name}: {e}", flush=True)

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=True)


def ttft(client: LLMClient, prompt: str, **params: Any) -> float:
    t0 = time.monotonic()
    for _ in client.stream(prompt, max_tokens=2, end_id=-1, route="aggregated", **params):
        return time.monotonic() - t0
    raise RuntimeError("no token")


def priority(client: LLMClient, repo: TritonRepository, engine: Path) -> tuple[float, float]:
    with worker_on(repo, engine):
        idle = min(ttft(client, WORD * 128, priority=9) for _ in range(3))
        streams = Streams(client)
        for i in range(16):  # 8 fill the batch, 8 more wait behind them
            streams.start(f"low{i}", WORD * 64 + f" {i}", 400, priority=0)
        time.sleep(3.0)
        busy = ttft(client, WORD * 128, priority=9)
        streams.close()
    return idle, busy


def chunking(client: LLMClient, repo: TritonRepository, engine: Path, long_prompt: int,
             chunked: bool) -> list[float]:
    with worker_on(repo, engine, enable_chunked_prefill=str(chunked).lower()):
        streams = Streams(client)
        for i in range(4):
            streams.start(f"d{i}", WORD * 32 + f" {i}", 2000)
        while not all(len(streams.times[f"d{i}"]) >= 3 for i in range(4)):
            time.sleep(0.05)
        start = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            futures = []
            for k in range(3):
                futures.append(pool.submit(client.generate, WORD * long_prompt + f" {k}",
                                           max_tokens=1, route="aggregated"))
                time.sleep(0.3)
            for f in futures:
                assert f.result()["num_input_tokens"] >= long_prompt
        end = time.monotonic()
        streams.close()
    gaps = []
    for i in range(4):
        times = [t for t in streams.times[f"d{i}"] if start <= t <= end + 0.5]
        gaps += [b - a for a, b in itertools.pairwise(times)]
    return gaps


def fairness(client: LLMClient, repo: TritonRepository, engine: Path, weights: str,
             batch: int, requests_b: int = 20) -> tuple[float, float]:
    """Shares of the tokens generated while both tenants are backlogged: A sends 10x more
    requests than B, all at once (open loop), as streams, so every token has a time.

    The window opens when the last of the first `batch` requests admitted (in arrival order,
    before any queue formed) is done, so every running sequence from then on was admitted by
    the fair queue; it closes when B's last request gets its first token, after which B has
    nothing waiting. Tokens are counted by arrival time within the window."""
    streams = Streams(client)
    names = []
    with worker_on(repo, engine, tenant_weights=weights):
        for k in range(10 * requests_b):
            for tenant in ("A", "B") if k % 10 == 0 else ("A",):
                name = f"{tenant}{k}"
                names.append(name)
                streams.start(name, WORD * 16 + f" {name}", 24, tenant=tenant)
        b_names = [n for n in names if n.startswith("B")]
        while not all(len(streams.times[n]) >= 24 for n in b_names):
            time.sleep(0.2)
        streams.close()  # A's remaining requests are cancelled
    times = {n: t for n, t in streams.times.items() if t}
    first_batch = sorted(times, key=lambda n: times[n][0])[:batch]
    opens = max(times[n][-1] for n in first_batch)
    closes = max(times[n][0] for n in b_names)
    if closes <= opens:
        raise RuntimeError("B's queue emptied before the first batch finished: no window")
    tokens = {t: sum(opens <= x <= closes for n in times if n.startswith(t) for x in times[n])
              for t in "AB"}
    total = tokens["A"] + tokens["B"]
    return tokens["A"] / total, tokens["B"] / total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR)
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--chunk-budget", type=int, default=256)
    ap.add_argument("--parts", default="priority,chunking,fairness", help="which to measure")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # Every model of the server (preprocessing validates prompt lengths) takes the long prompts.
        base = engine_variant(args.engine, root / "base", max_seq_len=args.long_prompt + 256)
        small_batch = engine_variant(base, root / "batch8", max_num_seqs=8)
        chunked = engine_variant(base, root / "chunked", max_num_batched_tokens=args.chunk_budget)
        whole = engine_variant(base, root / "whole", max_num_batched_tokens=args.long_prompt + 256)
        opts = ServerOptions(http_port=free_port(), grpc_port=free_port(),
                             metrics_port=free_port(), engine_dir=base,
                             log_file=root / "triton.log")
        with TritonServer(opts) as server:
            server.wait_ready(progress=True)
            client = LLMClient(opts.http_url)
            repo = opts.repository()
            try:
                if "priority" in parts:
                    measure_priority(client, repo, small_batch)
                if "chunking" in parts:
                    measure_chunking(client, repo, whole, chunked, args)
                if "fairness" in parts:
                    measure_fairness(client, repo, small_batch)
            except Exception:
                log = (root / "triton.log").read_text(errors="replace").splitlines()
                print("[sched] failed; the server log ends:", *log[-60:], sep="\n", flush=True)
                raise
    return 0


def measure_priority(client: LLMClient, repo: TritonRepository, small_batch: Path) -> None:
    print("[sched] priority: TTFT of a priority-9 request (128-token prompt)", flush=True)
    idle, busy = priority(client, repo, small_batch)
    print(f"  idle server                   {idle * 1e3:8.1f} ms")
    print(f"  batch full of priority 0      {busy * 1e3:8.1f} ms   ({busy / idle:.2f}x idle)")


def measure_chunking(client: LLMClient, repo: TritonRepository, whole: Path, chunked: Path,
                     args: argparse.Namespace) -> None:
    print(f"[sched] chunked prefill: 4 streams while 3 prompts of {args.long_prompt} tokens "
          "arrive", flush=True)
    off = chunking(client, repo, whole, args.long_prompt, chunked=False)
    on = chunking(client, repo, chunked, args.long_prompt, chunked=True)
    p95_off, p95_on = percentile(off, 0.95) * 1e3, percentile(on, 0.95) * 1e3
    print(f"  TPOT p95 without chunking     {p95_off:8.1f} ms")
    print(f"  TPOT p95 with {args.chunk_budget}-token chunks  {p95_on:8.1f} ms   "
          f"({p95_off / p95_on:.2f}x better)")


def measure_fairness(client: LLMClient, repo: TritonRepository, small_batch: Path) -> None:
    print("[sched] fairness: A sends 10x more requests than B", flush=True)
    for weights, want in (("{}", 0.5), ('{"A": 3, "B": 1}', 0.75)):
        a, b = fairness(client, repo, small_batch, weights, batch=8)
        print(f"  weights {weights:<18} A {a:.2f}  B {b:.2f}   (fair A share {want:.2f}, "
              f"off by {abs(a - want) / want:.0%})")


if __name__ == "__main__":
    sys.exit(main())
