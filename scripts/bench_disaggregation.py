#!/usr/bin/env python3
"""KV handoff and disaggregated serving, measured in one run.

1. Transport bandwidth: pulling 1, 4, 16 and 64 MiB of KV blocks from a pool owned by another
   process, over `host_shm` and `nixl`, against a plain single-threaded memcpy of the same size
   in one process (libc memmove; warm buffers; median of repeats).
2. Handoff against prefill: requests with a 512-token prompt forced through prefill -> decode
   on the server; per transport, the mean KV pull time (decode side) against the mean prefill
   time it replaces (prefill side), from the server's histograms.
3. Mixed workload: short and long prompts interleaved, streamed at a fixed concurrency, routed
   aggregated, disaggregated and auto (conditional); TTFT and TPOT percentiles per class.

4. (`--cross-server`, alone) The handoff between servers: the same NIXL pulls, decode pulling
   from a prefill server of its own (a cluster of front, prefill and decode servers on loopback,
   docs/cluster.md) against decode pulling within one server; KV bandwidth and mean pull time.

    python scripts/bench_disaggregation.py --start-server   # starts a server on free ports
    python scripts/bench_disaggregation.py --skip-server    # part 1 only
    python scripts/bench_disaggregation.py --cross-server   # part 4 only (starts 4 servers)
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from python_backends.bench.client import LLMClient, StreamResult, percentile
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.flag_board import BoardCache, FlagBoard
from python_backends.kv_transfer import nixl
from python_backends.kv_transfer.base import KVHandle, KVSink
from python_backends.kv_transfer.host_shm import HostShmSink, HostShmSource, SharedPool
from python_backends.kv_transfer.layout import KVLayout, allocate_pool
from python_backends.metrics_text import histogram_mean, metric_delta, scrape
from python_backends.ops.cluster import Cluster, ClusterPlan
from python_backends.ops.launcher import ServerOptions, TritonServer, free_port, server_for

MIB = 1 << 20
SIZES_MIB = (1, 4, 16, 64)
# One block = 1 MiB (two 512 KiB planes), so a size in MiB is a block count. Successive repeats
# copy successive ranges of a pool 8x the L3 cache, so no copy (memcpy included) reads warm data.
BENCH_LAYOUT = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, block_size=128,
                        dtype="float32", num_blocks=256)


# -- 1. transport bandwidth ---------------------------------------------------------------------

def _owner(conn: Any) -> None:
    """Child process: owns the pools and keeps its NIXL agents progressing until told to stop.

    Two NIXL cases: a prefill group offering only NIXL keeps its pool in anonymous memory with
    huge pages ("nixl"); one that also offers host_shm keeps it in /dev/shm, which has 4 KiB
    pages here ("nixl_shm_pool", the default repository's prefill)."""
    shared = SharedPool.create(BENCH_LAYOUT)
    shared.tensor.copy_(torch.randn(BENCH_LAYOUT.shape))
    sources: dict[str, Any] = {"host_shm": HostShmSource(shared.name)}
    if nixl.available():
        anon = allocate_pool(BENCH_LAYOUT)
        anon.copy_(shared.tensor)
        sources["nixl"] = nixl.NixlSource(anon, nixl.agent_name("bench-owner"))
        sources["nixl_shm_pool"] = nixl.NixlSource(shared.tensor, nixl.agent_name("bench-shm"))
    conn.send({k: s.location() for k, s in sources.items()})
    while not conn.poll(0.0005):
        for s in sources.values():
            s.released()
    for s in sources.values():
        s.close()
    shared.close()


def _median_seconds(fn: Any, repeats: int) -> float:
    """Median time of `fn(i)` over repeats i = 1..repeats, after a warm-up fn(0) (first-touch
    page faults, NIXL connection set-up)."""
    fn(0)
    times = []
    for i in range(1, repeats + 1):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _blocks(size: int, i: int) -> list[int]:
    start = (i * size) % BENCH_LAYOUT.num_blocks
    return list(range(start, start + size))


def bench_transports(repeats: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child,), daemon=True)
    proc.start()
    locations = parent.recv()
    board = FlagBoard.create(size=8)
    boards = BoardCache()
    dst = allocate_pool(BENCH_LAYOUT)
    dst.view(-1).view(torch.uint8).fill_(1)  # touch every page before timing
    sinks: dict[str, KVSink] = {"host_shm": HostShmSink(BENCH_LAYOUT, dst, boards)}
    if "nixl" in locations:
        sinks["nixl"] = nixl.NixlSink(BENCH_LAYOUT, dst, nixl.agent_name("bench-puller"), boards)
        sinks["nixl_shm_pool"] = sinks["nixl"]
    src_local = allocate_pool(BENCH_LAYOUT).view(-1).view(torch.uint8)
    src_local.random_(0, 255)
    dst_local = allocate_pool(BENCH_LAYOUT).view(-1).view(torch.uint8)
    dst_local.fill_(1)
    rows = []
    try:
        for size in SIZES_MIB:
            nbytes = size * MIB

            def memcpy(i: int, n: int = nbytes) -> None:
                off = (i * n) % src_local.numel()
                ctypes.memmove(dst_local.data_ptr() + off, src_local.data_ptr() + off, n)

            row: dict[str, Any] = {"MiB": size,
                                   "memcpy": nbytes / _median_seconds(memcpy, repeats) / (1 << 30)}
            for kind, sink in sinks.items():
                ticket = board.acquire()

                def pull(i: int, sink: KVSink = sink, kind: str = kind, size: int = size,
                         ticket: int = ticket) -> None:
                    blocks = _blocks(size, i)
                    handle = KVHandle(sink.kind, "bench-owner", BENCH_LAYOUT, tuple(blocks),
                                      size * BENCH_LAYOUT.block_size, time.time() + 3600,
                                      board.name, ticket, locations[kind])
                    sink.pull(handle, blocks)
                    if i == repeats:
                        sink.flush()  # releases go out batched (see kv_transfer.nixl)

                row[kind] = nbytes / _median_seconds(pull, repeats) / (1 << 30)
                board.release(ticket)
            rows.append(row)
            print(f"[bench]   {size:>3} MiB: " + ", ".join(
                f"{k} {v:.2f} GiB/s" for k, v in row.items() if k != "MiB"), flush=True)
    finally:
        parent.send("stop")
        proc.join(10)
        for sink in set(sinks.values()):
            sink.close()
        boards.close()
        board.close()
    return rows


def print_transports(rows: list[dict[str, Any]]) -> None:
    kinds = [k for k in rows[0] if k not in ("MiB", "memcpy")]
    print("\nKV pull across processes vs memcpy in one process (GiB/s; ratio to memcpy)")
    print(f"{'size':>8}{'memcpy':>10}" + "".join(f"{k:>12}{'ratio':>7}" for k in kinds))
    for r in rows:
        print(f"{r['MiB']:>5} MiB{r['memcpy']:>10.2f}" + "".join(
            f"{r[k]:>12.2f}{r[k] / r['memcpy']:>7.2f}" for k in kinds))


# -- 2 and 3: through the server -----------------------------------------------------------------

def make_prompt(tokenizer: Any, n_tokens: int, salt: int) -> str:
    words = ("river", "mountain", "lantern", "harbor", "meadow", "engine", "violet", "signal")
    text = f"Note {salt}: " + " ".join(words[(salt + 3 * j) % len(words)]
                                      for j in range(n_tokens * 2))
    specials = len(tokenizer("", add_special_tokens=True)["input_ids"])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: n_tokens - specials]
    return str(tokenizer.decode(ids))


def _hist_mean(before: dict[str, Any], after: dict[str, Any], name: str, **labels: str) -> float:
    mean = histogram_mean(before, after, name, **labels)
    return float("nan") if mean is None else mean


def bench_handoff(client: LLMClient, metrics_url: str, tokenizer: Any, transports: list[str],
                  prompt_tokens: int, n: int) -> list[dict[str, Any]]:
    rows = []
    for kind in transports:
        before = scrape(metrics_url)
        lengths = []
        for i in range(n):
            out = client.generate(make_prompt(tokenizer, prompt_tokens, 100 + i), max_tokens=2,
                                  route="disaggregated", kv_transport=kind, end_id=-1)
            lengths.append(out["num_input_tokens"])
        time.sleep(0.5)
        after = scrape(metrics_url)
        handoff = _hist_mean(before, after, "llm_kv_transfer_duration_seconds", transport=kind)
        prefill = _hist_mean(before, after, "llm_request_prefill_time_seconds",
                             model="prefill")
        nbytes = metric_delta(before, after, "llm_kv_transfer_bytes_total", transport=kind) / n
        rows.append({"transport": kind, "prompt_tokens": round(statistics.mean(lengths)),
                     "requests": n,
                     "kv_MiB": nbytes / MIB, "handoff_ms": handoff * 1e3,
                     "prefill_ms": prefill * 1e3, "ratio": handoff / prefill})
        r = rows[-1]
        print(f"[bench]   {kind}: handoff {r['handoff_ms']:.1f} ms for {r['kv_MiB']:.1f} MiB, "
              f"prefill {r['prefill_ms']:.0f} ms ({100 * handoff / prefill:.1f}%)", flush=True)
    return rows


def _nixl_pulls(client: LLMClient, metrics_url: str, tokenizer: Any, prompt_tokens: int,
                n: int) -> dict[str, float]:
    """n prompts through prefill -> decode over NIXL; the decode side's pull figures."""
    client.generate("Hello", max_tokens=2, route="disaggregated", kv_transport="nixl")  # warm-up
    before = scrape(metrics_url)
    for i in range(n):
        client.generate(make_prompt(tokenizer, prompt_tokens, 500 + i), max_tokens=2,
                        route="disaggregated", kv_transport="nixl", end_id=-1)
    time.sleep(0.5)
    after = scrape(metrics_url)
    nbytes = metric_delta(before, after, "llm_kv_transfer_bytes_total", transport="nixl")
    seconds = metric_delta(before, after, "llm_kv_transfer_duration_seconds_sum",
                           transport="nixl")
    pulls = metric_delta(before, after, "llm_kv_transfer_duration_seconds_count",
                         transport="nixl")
    return {"pulls": pulls, "MiB_per_pull": nbytes / max(pulls, 1) / MIB,
            "ms_per_pull": 1e3 * seconds / max(pulls, 1),
            "GiB_per_s": nbytes / seconds / (1 << 30) if seconds else float("nan")}


def bench_cross_server(engine: Path, tokenizer: Any, prompt_tokens: int, n: int
                       ) -> dict[str, dict[str, float]]:
    """NIXL pulls within one server, then between a prefill and a decode server."""
    rows = {}
    log_dir = Path("/tmp/bench-disaggregation-cluster")
    log_dir.mkdir(exist_ok=True)
    print("[bench] 4a. one server: prefill and decode instances in it ...", flush=True)
    opts = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                         engine_dir=engine, log_file=log_dir / "all.log")
    with TritonServer(opts) as server:
        server.wait_ready(progress=True)
        rows["same server"] = _nixl_pulls(LLMClient(opts.http_url), opts.metrics_url, tokenizer,
                                          prompt_tokens, n)
    print("[bench] 4b. a front, a prefill and a decode server ...", flush=True)
    cluster = Cluster(ClusterPlan(prefill=1, decode=1, engine_dir=engine, log_dir=log_dir)
                      .servers(ports=free_port))
    cluster.start(progress=True)
    try:
        decode = cluster.of_role("decode")[0].options
        rows["across servers"] = _nixl_pulls(LLMClient(cluster.front.options.http_url),
                                             decode.metrics_url, tokenizer, prompt_tokens, n)
    finally:
        cluster.stop()
    return rows


def print_cross_server(rows: dict[str, dict[str, float]], prompt_tokens: int) -> None:
    same = rows["same server"]["GiB_per_s"]
    print(f"\nKV pulls over NIXL, {prompt_tokens}-token prompts (decode side, means)")
    print(f"{'':<16}{'pulls':>6}{'MiB/pull':>10}{'ms/pull':>9}{'GiB/s':>8}{'ratio':>7}")
    for name, r in rows.items():
        print(f"{name:<16}{r['pulls']:>6.0f}{r['MiB_per_pull']:>10.2f}{r['ms_per_pull']:>9.2f}"
              f"{r['GiB_per_s']:>8.2f}{r['GiB_per_s'] / same:>7.2f}")


def bench_mixed(client: LLMClient, tokenizer: Any, routes: list[str], n: int, short: int,
                long: int, output_tokens: int, concurrency: int) -> list[dict[str, Any]]:
    work = [(make_prompt(tokenizer, long if i % 2 else short, i), "long" if i % 2 else "short")
            for i in range(n)]
    rows = []
    for route in routes:
        def one(item: tuple[str, str], route: str = route) -> tuple[str, StreamResult]:
            r = client.stream_collect(item[0], max_tokens=output_tokens, end_id=-1,
                                      exclude_input_in_output=True, route=route)
            return item[1], r

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, work))
        seconds = time.perf_counter() - t0
        for cls in ("short", "long", "all"):
            sel = [r for c, r in results if cls in ("all", c)]
            ttfts = [r.ttft for r in sel]
            tpots = [t for r in sel if (t := r.tpot) is not None]
            rows.append({"route": route, "class": cls, "requests": len(sel),
                         "tok_per_s": sum(len(r.output_ids) for r in sel) / seconds,
                         "ttft_p50_ms": percentile(ttfts, 0.5) * 1e3,
                         "ttft_p95_ms": percentile(ttfts, 0.95) * 1e3,
                         "tpot_p50_ms": percentile(tpots, 0.5) * 1e3,
                         "tpot_p95_ms": percentile(tpots, 0.95) * 1e3})
        print(f"[bench]   {route}: {seconds:.1f} s", flush=True)
    return rows


def print_mixed(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'route':<15}{'class':<7}{'reqs':>5}{'TTFT p50':>10}{'p95':>8}{'TPOT p50':>10}"
          f"{'p95':>8}   (ms)")
    for r in rows:
        print(f"{r['route']:<15}{r['class']:<7}{r['requests']:>5}{r['ttft_p50_ms']:>10.0f}"
              f"{r['ttft_p95_ms']:>8.0f}{r['tpot_p50_ms']:>10.1f}{r['tpot_p95_ms']:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    ap.add_argument("--start-server", action="store_true", help="start a server on free ports")
    ap.add_argument("--skip-server", action="store_true", help="transport bandwidth only")
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR)
    ap.add_argument("--repeats", type=int, default=10, help="timed pulls per size")
    ap.add_argument("--handoff-prompt-tokens", type=int, default=512)
    ap.add_argument("--handoff-requests", type=int, default=5)
    ap.add_argument("--mixed-requests", type=int, default=16)
    ap.add_argument("--short-tokens", type=int, default=64)
    ap.add_argument("--long-tokens", type=int, default=768)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--cross-server", action="store_true",
                    help="only part 4: NIXL pulls between servers vs within one")
    args = ap.parse_args(argv)
    if args.cross_server:
        from transformers import AutoTokenizer

        rows = bench_cross_server(args.engine, AutoTokenizer.from_pretrained(str(args.engine)),
                                  args.handoff_prompt_tokens, args.handoff_requests)
        print_cross_server(rows, args.handoff_prompt_tokens)
        return 0

    print("[bench] 1. KV transport bandwidth across processes ...", flush=True)
    transport_rows = bench_transports(args.repeats)
    if args.skip_server:
        print_transports(transport_rows)
        return 0

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.engine))
    log_file = Path("/tmp/bench-disaggregation-triton.log")
    with server_for(args.start_server, args.url, args.metrics_url, args.engine,
                    log_file) as (url, metrics_url):
        client = LLMClient(url)
        client.generate("Hello", max_tokens=2, route="disaggregated")  # warm-up both paths
        client.generate("Hello", max_tokens=2, route="aggregated")
        transports = [k for k in transport_rows[0] if k in ("nixl", "host_shm")]
        print(f"[bench] 2. handoff vs prefill, {args.handoff_prompt_tokens}-token prompts ...",
              flush=True)
        handoff_rows = bench_handoff(client, metrics_url, tokenizer, transports,
                                     args.handoff_prompt_tokens, args.handoff_requests)
        print(f"[bench] 3. mixed workload: {args.mixed_requests} requests, "
              f"{args.short_tokens}/{args.long_tokens}-token prompts, {args.output_tokens} "
              f"output tokens, concurrency {args.concurrency} ...", flush=True)
        mixed_rows = bench_mixed(client, tokenizer, ["aggregated", "disaggregated", "auto"],
                                 args.mixed_requests, args.short_tokens, args.long_tokens,
                                 args.output_tokens, args.concurrency)
    print_transports(transport_rows)
    print("\nHandoff time vs the prefill time it replaces (means)")
    for r in handoff_rows:
        print(f"  {r['transport']:<9} {r['prompt_tokens']} tokens, {r['kv_MiB']:.1f} MiB: "
              f"handoff {r['handoff_ms']:.1f} ms, prefill {r['prefill_ms']:.0f} ms -> "
              f"{100 * r['ratio']:.1f}% (target < 10%)")
    print_mixed(mixed_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
