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

Those differences are between rounds, so the engine's round-to-round noise (tens of ms here)
hides what the gateway adds. The paired measurement that follows sees that alone:
--concurrency / 2 slots each send --pairs-per-slot pairs one after the other, one request of
each pair to Triton's gRPC stream and its twin (the same inputs, a cache salt of its own, so
neither reads the other's prefix) through the gateway, `proxied` and `openai` in turn; the
slots drift apart, so requests arrive at any point of the engine's steps, as under a steady
load. Twins share the engine's steps, so the difference between them is the gateway's path:
its added TTFT, the delay it adds to each streamed token's arrival and the change of the time
between tokens, p50 over pairs. --gateway-cpus gives the gateway cores of its own (the server
and this client share the others), as in front of servers and clients on other machines.

    python scripts/bench_gateway.py [--concurrency 32] [--max-tokens 32] [--rounds 3]
                                    [--pairs-per-slot 13] [--gateway-cpus 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import requests
from tritonclient.grpc import service_pb2_grpc

from python_backends.bench.client import percentile
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.gateway.triton import ensemble_request, read_piece
from python_backends.metrics_text import histogram_mean, scrape
from python_backends.net import free_port
from python_backends.ops.launcher import ServerOptions, TritonServer, start_gateway, stop_process
from python_backends.procfs import cpu_seconds

PROMPT = "Write a long story about a lighthouse keeper and the sea. Chapter {i}:"
# one streamed request: (seconds to its first token, seconds between its tokens)
Sample = tuple[float, list[float]]
# one request: when it was sent and when each of its events arrived (perf_counter)
Timeline = tuple[float, list[float]]
# one request of a pair, sent when the barrier lets both twins go
Twin = Callable[[int, threading.Barrier], Timeline]


def sse_events(r: requests.Response) -> Iterator[dict[str, object]]:
    for line in r.iter_lines():
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            yield json.loads(line[5:])


def sample(timeline: Timeline) -> Sample:
    """A stream's TTFT and gaps from when it was sent and when its events arrived."""
    start, times = timeline
    if not times:
        raise RuntimeError("the stream sent nothing")
    return times[0] - start, [b - a for a, b in itertools.pairwise(times)]


def sse_timeline(url: str, body: dict[str, Any],
                 go: threading.Barrier | None = None) -> Timeline:
    """POST `body` to an SSE endpoint (after `go`, when given); when it was sent and when each
    event arrived."""
    if go is not None:
        go.wait()
    start = time.perf_counter()
    with requests.post(url, json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        return start, [time.perf_counter() for _ in sse_events(r)]


def grpc_timeline(address: str, inputs: dict[str, Any],
                  go: threading.Barrier | None = None) -> Timeline:
    """One request on Triton's gRPC stream, built as the gateway builds it (a stream of its
    own, opened before `go`, ended after 600 s at the latest): when it was sent and when each
    response arrived."""
    outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    with grpc.insecure_channel(address) as channel:
        responses = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter(outbox.get, None), timeout=600)
        try:
            request = ensemble_request(inputs, {})
            if go is not None:
                go.wait()
            start = time.perf_counter()
            outbox.put(request)
            times: list[float] = []
            for response in responses:
                times.append(time.perf_counter())
                if response.error_message:
                    raise RuntimeError(f"gRPC stream failed: {response.error_message}")
                if read_piece(response.infer_response).finish_reason:
                    return start, times
            raise RuntimeError("the gRPC stream ended before the request finished")
        finally:
            outbox.put(None)
            responses.cancel()


def kserve(url: str, max_tokens: int) -> Callable[[int], Sample]:
    def one(i: int) -> Sample:
        body: dict[str, Any] = {"text_input": PROMPT.format(i=i), "max_tokens": max_tokens,
                                "stream": True, "end_id": -1}
        return sample(sse_timeline(f"{url}/v2/models/ensemble/generate_stream", body))

    return one


def grpc_stream(address: str, max_tokens: int) -> Callable[[int], Sample]:
    """Triton's gRPC streaming endpoint, as the gateway calls it (one client per request)."""
    def one(i: int) -> Sample:
        return sample(grpc_timeline(address, {"text_input": PROMPT.format(i=i),
                                              "max_tokens": max_tokens, "stream": True,
                                              "end_id": -1}))

    return one


def openai(url: str, max_tokens: int) -> Callable[[int], Sample]:
    def one(i: int) -> Sample:
        # OpenAI has no end_id: the prompt asks for a long answer
        body: dict[str, Any] = {"model": "smollm2", "prompt": PROMPT.format(i=i),
                                "max_tokens": max_tokens, "temperature": 0, "stream": True}
        return sample(sse_timeline(f"{url}/v1/completions", body))

    return one


def run_round(one: Callable[[int], Sample], concurrency: int, offset: int) -> list[Sample]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(offset, offset + concurrency)))


def kserve_twin(url: str, max_tokens: int) -> Twin:
    def one(i: int, go: threading.Barrier) -> Timeline:
        body = {**twin_inputs(i, max_tokens, "gateway"), "end_id": -1}
        return sse_timeline(f"{url}/v2/models/ensemble/generate_stream", body, go)

    return one


def openai_twin(url: str, max_tokens: int) -> Twin:
    def one(i: int, go: threading.Barrier) -> Timeline:
        inputs = twin_inputs(i, max_tokens, "gateway")
        body = {"model": "smollm2", "prompt": inputs["text_input"], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "cache_salt": inputs["cache_salt"]}
        return sse_timeline(f"{url}/v1/completions", body, go)

    return one


def grpc_twin(address: str, max_tokens: int, end_id: bool) -> Twin:
    """The twin on Triton's gRPC stream; `end_id`: ignore the end token, as the KServe twin
    asks (OpenAI has no such field)."""
    def one(i: int, go: threading.Barrier) -> Timeline:
        inputs = twin_inputs(i, max_tokens, "direct")
        if end_id:
            inputs["end_id"] = -1
        return grpc_timeline(address, inputs, go)

    return one


def twin_inputs(i: int, max_tokens: int, side: str) -> dict[str, Any]:
    """A pair's inputs: one prompt, greedy, a cache salt per request."""
    return {"text_input": PROMPT.format(i=i), "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "cache_salt": f"{side}-{i}"}


def measure_pairs(ways: dict[str, tuple[Twin, Twin]], concurrency: int,
                  per_slot: int) -> dict[str, list[tuple[Timeline, Timeline]]]:
    """concurrency / 2 slots, each sending `per_slot` pairs one after the other, the ways in
    turn; a pair's twins are sent at once (a barrier), the slots drift apart as they go, so
    requests arrive at any point of the engine's steps, as a steady load does. A slot's first
    pair is left out: all slots start it at the same moment, on an idle engine."""
    names = list(ways)
    results: dict[str, list[tuple[Timeline, Timeline]]] = {name: [] for name in ways}
    lock = threading.Lock()
    slots = max(1, concurrency // 2)

    def slot(k: int) -> None:
        go = threading.Barrier(2)
        with ThreadPoolExecutor(2) as twins:
            for j in range(per_slot):
                name = names[(k + j) % len(names)]
                direct, gateway = ways[name]
                i = 10_000 + k * per_slot + j
                d, g = twins.submit(direct, i, go), twins.submit(gateway, i, go)
                pair = (d.result(timeout=900), g.result(timeout=900))
                if j:
                    with lock:
                        results[name].append(pair)

    t0 = time.monotonic()
    with ThreadPoolExecutor(slots) as pool:
        for f in [pool.submit(slot, k) for k in range(slots)]:
            f.result()
    print(f"[bench] paired: {time.monotonic() - t0:5.1f} s", flush=True)
    return results


def pair_deltas(pairs: list[tuple[Timeline, Timeline]]) -> dict[str, float]:
    """What the gateway added, p50 over pairs: TTFT, each token's arrival (pairs whose streams
    have as many events), the mean time between tokens."""
    ttft, arrival, gap = [], [], []
    for (d_start, d), (g_start, g) in pairs:
        ttft.append((g[0] - g_start) - (d[0] - d_start))
        if len(d) == len(g) > 1:
            arrival.append(statistics.median(b - a for a, b in zip(d, g, strict=True)))
            gap.append((g[-1] - g[0] - (d[-1] - d[0])) / (len(g) - 1))
    ms = 1000
    firsts = [(d[0] - d_start, g[0] - g_start) for (d_start, d), (g_start, g) in pairs]
    return {"pairs": len(pairs), "matched": len(arrival),
            "ttft_direct_p50_ms": ms * percentile([d for d, _ in firsts], 0.5),
            "ttft_gateway_p50_ms": ms * percentile([g for _, g in firsts], 0.5),
            "ttft_p50_ms": ms * percentile(ttft, 0.5), "ttft_p95_ms": ms * percentile(ttft, 0.95),
            "arrival_p50_ms": ms * percentile(arrival, 0.5),
            "itl_p50_ms": ms * percentile(gap, 0.5)}


def report_pairs(results: dict[str, list[tuple[Timeline, Timeline]]],
                 args: argparse.Namespace) -> None:
    print(f"\npaired: {args.concurrency // 2} slots sending {args.pairs_per_slot} pairs each "
          "(Triton gRPC and the gateway, the same inputs, sent at once)")
    print(f"{'way':<8} {'pairs':>6} {'TTFT p50 grpc/gateway':>22} {'TTFT +p50':>10} "
          f"{'TTFT +p95':>10} {'token arrival +p50':>19} {'ms/token +p50':>14}")
    for name, pairs in results.items():
        if not pairs:
            continue
        d = pair_deltas(pairs)
        both = f"{d['ttft_direct_p50_ms']:.1f} / {d['ttft_gateway_p50_ms']:.1f}"
        print(f"{name:<8} {d['pairs']:>6} {both:>22} "
              f"{d['ttft_p50_ms']:>9.2f}  {d['ttft_p95_ms']:>9.2f}  "
              f"{d['arrival_p50_ms']:>18.2f}  {d['itl_p50_ms']:>13.3f}"
              f"   ({d['matched']} with as many events)")


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
    p.add_argument("--pairs-per-slot", type=int, default=13)
    p.add_argument("--gateway-cpus", default="",
                   help="CPUs for the gateway alone (e.g. 1), the others for the Triton server "
                   "and this client: a gateway with cores of its own, as in front of servers "
                   "and clients on other machines")
    p.add_argument("--engine", type=Path, default=Path(DEFAULT_ENGINE_DIR))
    args = p.parse_args(argv)
    gateway_cpus, server_cpus = split_cpus(p, args.gateway_cpus)
    # This client's 32 threads take each event's time as they get the GIL: hand it over
    # sooner than the default 5 ms, for both ways alike.
    sys.setswitchinterval(0.0002)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        opts = ServerOptions(http_port=free_port(), grpc_port=free_port(),
                             metrics_port=free_port(), engine_dir=args.engine,
                             log_file=Path(tmp) / "server.log")
        os.sched_setaffinity(0, server_cpus)  # the server's processes inherit it
        with TritonServer(opts) as server:
            server.wait_ready(timeout_s=600, progress=True)
            os.sched_setaffinity(0, gateway_cpus)  # the gateway inherits it
            port = free_port()
            gateway = start_gateway(opts, port)
            os.sched_setaffinity(0, server_cpus)  # this client: the gateway's core is its own
            try:
                gw = f"http://127.0.0.1:{port}"
                ways = {"direct": kserve(opts.http_url, args.max_tokens),
                        "grpc": grpc_stream(opts.grpc_address, args.max_tokens),
                        "proxied": kserve(gw, args.max_tokens),
                        "openai": openai(gw, args.max_tokens)}
                results, cpu = measure(ways, args.concurrency, args.rounds,
                                       lambda: cpu_seconds(gateway.pid))
                twins = {"proxied": (grpc_twin(opts.grpc_address, args.max_tokens, True),
                                     kserve_twin(gw, args.max_tokens)),
                         "openai": (grpc_twin(opts.grpc_address, args.max_tokens, False),
                                    openai_twin(gw, args.max_tokens))}
                paired = measure_pairs(twins, args.concurrency, args.pairs_per_slot)
                handoff = histogram_mean({}, scrape(f"{gw}/metrics"),
                                         "gateway_request_overhead_seconds")
            finally:
                stop_process(gateway)
    report(results, cpu, args)
    report_pairs(paired, args)
    if handoff is not None:
        print(f"the gateway's own hand-off time (arrival to the gRPC call: parsing, routing), "
              f"mean over all requests: {1000 * handoff:.2f} ms")
    return 0


def split_cpus(p: argparse.ArgumentParser, spec: str) -> tuple[set[int], set[int]]:
    """(the gateway's CPUs, the server's) from --gateway-cpus; all of them for both if empty."""
    every = os.sched_getaffinity(0)
    if not spec:
        return every, every
    try:
        gateway = {int(c) for c in spec.split(",")}
    except ValueError:
        p.error(f"--gateway-cpus: expected CPU numbers like 1 or 2,3, got {spec!r}")
    if not gateway < every:
        p.error(f"--gateway-cpus {spec}: leave the server at least one of CPUs {sorted(every)}")
    return gateway, every - gateway


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
          f"{args.rounds} rounds (interleaved)"
          + (f", the gateway on CPUs {args.gateway_cpus}" if args.gateway_cpus else ""))
    print(f"{'way':<8} {'TTFT p50':>9} {'TTFT p95':>9} {'ms/token':>9} "
          f"{'gateway CPU ms/token':>21}")
    rows = {name: summary(samples) for name, samples in results.items() if samples}
    if not rows:
        return
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
