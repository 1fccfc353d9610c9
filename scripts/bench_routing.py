#!/usr/bin/env python3
"""Prefix-aware against least-loaded routing, measured through the gateway in one run.

Starts --servers Triton servers (role `aggregated`: the whole pipeline with the worker engine
alone, prefix caching on) and, for each policy, a gateway in front of them. The workload is
multi-turn chat, as the official `openai` client sends it: --conversations conversations run
at once, each about a text of its own (--context-tokens tokens of scripts/data/quality-text.txt,
from a different place for each), and each of its --turns turns resends the whole conversation
plus a new question and streams --answer-tokens tokens (greedy). A later turn's prompt starts
with the earlier one, so the server that served it holds most of its KV; least-loaded routing
ignores that, prefix-aware routing (docs/gateway.md, "Choosing a server") weighs it against
load. Every run uses a cache salt of its own, so no run reuses another's KV. The policies run
in turn, their order swapped each round, so the machine's drift falls on both.

Printed per policy and round: TTFT p50 and p95 of the first turns and of the later ones, the
servers' prefix-cache hit rate (cached prompt tokens over the prompt tokens of later turns),
and how the requests spread over the servers; then least-loaded's TTFT p50 of later turns
over prefix-aware's.

    python scripts/bench_routing.py [--servers 3] [--conversations 8] [--turns 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
from transformers import AutoTokenizer

from python_backends.bench.client import percentile
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.gateway.routing import DEFAULT_OVERLAP_WEIGHT
from python_backends.metrics_text import metric_sum, scrape
from python_backends.net import free_port
from python_backends.ops.launcher import ServerOptions, TritonServer, launch_gateway, stop_process

POLICIES = ("least_loaded", "prefix_aware")
TEXT = Path(__file__).resolve().parent / "data" / "quality-text.txt"
QUESTIONS = ["What is this text about?", "Which detail in it matters most, and why?",
             "What would you ask its author?", "Say it again in one sentence.",
             "What is left out of it?", "Who would enjoy reading it?"]
MODEL = "smollm2"
Turn = tuple[int, float, int]  # turn number, TTFT (s), prompt tokens


def contexts(engine: Path, n: int, tokens: int) -> list[str]:
    """n texts of `tokens` tokens each, cut from the shipped text at different places (it is
    read as a ring, so any n fits)."""
    tokenizer = AutoTokenizer.from_pretrained(str(engine))
    ids = tokenizer(TEXT.read_text())["input_ids"]
    step = max(1, len(ids) // n)
    ring = ids + ids
    return [str(tokenizer.decode(ring[i * step % len(ids):][:tokens])) for i in range(n)]


def conversation(client: openai.OpenAI, context: str, turns: int, answer_tokens: int,
                 salt: str) -> list[Turn]:
    messages: list[Any] = [  # the client's message types are TypedDicts
        {"role": "user", "content": f"Read this text.\n\n{context}\n\n{QUESTIONS[0]}"}]
    out = []
    for turn in range(turns):
        start, ttft, answer, usage = time.perf_counter(), 0.0, "", None
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=answer_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"cache_salt": salt})
        for chunk in stream:
            if chunk.choices and not ttft:
                ttft = time.perf_counter() - start
            if chunk.choices:
                answer += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        out.append((turn, ttft, usage.prompt_tokens if usage else 0))
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]}]
    return out


def run_policy(policy: str, servers: list[ServerOptions], texts: list[str],
               args: argparse.Namespace, tmp: Path, salt: str) -> dict[str, Any]:
    config = {"model": MODEL, "engine_dir": str(args.engine), "health_interval_s": 0.5,
              "backends": [{"name": f"server-{i}", "grpc": o.grpc_address,
                            "metrics": o.metrics_url} for i, o in enumerate(servers)],
              "routing": {"policy": policy, "overlap_weight": args.overlap_weight}}
    path = tmp / f"gateway-{policy}.json"
    path.write_text(json.dumps(config))
    port = free_port()
    gateway = launch_gateway(["--config", str(path)], "127.0.0.1", port,
                             log=tmp / f"gateway-{policy}.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=600)
        before = [scrape(o.metrics_url) for o in servers]
        with ThreadPoolExecutor(len(texts)) as pool:
            runs = list(pool.map(lambda text: conversation(
                client, text, args.turns, args.answer_tokens, salt), texts))
        after = [scrape(o.metrics_url) for o in servers]
    finally:
        stop_process(gateway)

    def delta(name: str, i: int) -> float:
        return metric_sum(after[i], name) - metric_sum(before[i], name)

    turns = [t for run in runs for t in run]
    later = [t for t in turns if t[0] > 0]
    hits = sum(delta("llm_prefix_cache_hits_total", i) for i in range(len(servers)))
    return {
        "first": [t[1] for t in turns if t[0] == 0], "later": [t[1] for t in later],
        "hit_rate": hits / max(1, sum(t[2] for t in later)),
        "spread": [int(delta("llm_requests_finished_total", i)) for i in range(len(servers))],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context-tokens", type=int, default=384)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--overlap-weight", type=float, default=DEFAULT_OVERLAP_WEIGHT,
                    help="prefix_aware's routing.overlap_weight (%(default)s, the gateway's "
                    "default)")
    args = ap.parse_args(argv)
    texts = contexts(args.engine, args.conversations, args.context_tokens)
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp_dir, ExitStack() as stack:
        tmp = Path(tmp_dir)
        servers = []
        for i in range(args.servers):
            opts = ServerOptions(http_port=free_port(), grpc_port=free_port(),
                                 metrics_port=free_port(), engine_dir=args.engine,
                                 log_file=tmp / f"server-{i}.log", role="aggregated")
            stack.enter_context(TritonServer(opts)).wait_ready(timeout_s=600, progress=True)
            servers.append(opts)
        for r in range(args.rounds):
            order = POLICIES if r % 2 == 0 else POLICIES[::-1]
            for policy in order:
                t0 = time.monotonic()
                results[policy].append(run_policy(policy, servers, texts, args, tmp,
                                                  salt=f"round-{r}-{policy}"))
                print(f"[routing] round {r + 1}/{args.rounds} {policy:<13} "
                      f"{time.monotonic() - t0:5.1f} s", flush=True)
    report(results, args)
    return 0


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"\n{args.servers} servers, {args.conversations} conversations x {args.turns} turns, "
          f"{args.context_tokens}-token texts, {args.answer_tokens}-token answers, "
          f"overlap_weight {args.overlap_weight:g}")
    print(f"{'policy':<13} {'round':>5} {'TTFT p50/p95 turn 1 (ms)':>26} "
          f"{'TTFT p50/p95 turns 2+ (ms)':>28} {'hit rate':>9}  requests per server")
    for policy, runs in results.items():
        for r, run in enumerate(runs):
            first, later = run["first"], run["later"]
            print(f"{policy:<13} {r + 1:>5} {percentile(first, 0.5) * 1e3:>12.0f} / "
                  f"{percentile(first, 0.95) * 1e3:<11.0f} {percentile(later, 0.5) * 1e3:>14.0f}"
                  f" / {percentile(later, 0.95) * 1e3:<11.0f} {run['hit_rate']:>8.0%}  "
                  f"{run['spread']}")
    for r in range(args.rounds):
        ll = percentile(results["least_loaded"][r]["later"], 0.5)
        pa = percentile(results["prefix_aware"][r]["later"], 0.5)
        print(f"round {r + 1}: TTFT p50 of turns 2+ is {ll / pa:.2f}x lower with prefix-aware "
              f"routing than with least-loaded")


if __name__ == "__main__":
    sys.exit(main())
