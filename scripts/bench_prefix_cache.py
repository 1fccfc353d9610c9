#!/usr/bin/env python3
"""Prefix caching measured through a running Triton server, in one run.

Starts a server and serves a multi-turn chat workload three times, reloading the `worker`
model in between: with prefix caching off, on, and on with the kv_store model behind it.
--conversations conversations (in parallel) of --turns turns share a system prompt of
--system-tokens tokens; each turn resends the conversation so far (system prompt, every earlier
question and answer) plus a new question, and generates --answer-tokens tokens. Printed per
mode: TTFT p50/p95 of the first turns and of the later ones, output tokens/s, and the hit rate
of reusable prompt tokens (the tokens an earlier request already sent: the system prompt after
its first use, and each conversation's history), from the server's own counters.

Then the store alone: the TTFT of a prompt whose --store-prefix-tokens prefix the worker
computes, against the same prompt's TTFT after the worker was reloaded (its pool empty), so
the prefix comes from the kv_store model.

    python scripts/bench_prefix_cache.py [--engine engines/smollm2] [--conversations 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from python_backends.bench.client import LLMClient, percentile
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.metrics_text import metric_sum, scrape
from python_backends.net import free_port
from python_backends.ops.launcher import ServerOptions, TritonServer

MODES = {  # worker parameters
    "off": {"enable_prefix_caching": "false", "kv_store": "off"},
    "on": {"enable_prefix_caching": "true", "kv_store": "off"},
    "on + store": {"enable_prefix_caching": "true", "kv_store": "auto"},
}
TOPICS = ["bread", "cheese", "rivers", "trains", "music", "chess", "tea", "bees", "clouds",
          "maps", "glass", "salt", "wool", "ships", "clocks", "paper"]


class Tokens:
    def __init__(self, engine: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(engine))

    def count(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))


def system_prompt(tokens: Tokens, n: int) -> str:
    sentence = ("You are a patient teacher. Answer in short, clear sentences, give one example "
                "for every idea, and say so when you are not sure. ")
    text = ""
    while tokens.count(text + sentence) < n:
        text += sentence
    return "<|im_start|>system\n" + text + "<|im_end|>\n"


def conversation(client: LLMClient, tokens: Tokens, system: str, topic: str, turns: int,
                 answer_tokens: int, salt: str) -> list[tuple[int, float, int, int]]:
    """(turn, TTFT, output tokens, reusable prompt tokens) of each turn."""
    history, out = system, []
    for turn in range(turns):
        question = f"<|im_start|>user\nTell me one more thing about {topic} ({turn}).<|im_end|>\n"
        prompt = history + question + "<|im_start|>assistant\n"
        result = client.stream_collect(prompt, max_tokens=answer_tokens, end_id=-1,
                                       route="aggregated", cache_salt=salt)
        reusable = tokens.count(history)  # the system prompt, or the conversation so far
        out.append((turn, result.ttft, len(result.output_ids), reusable))
        history = prompt + tokens.decode(result.output_ids) + "<|im_end|>\n"
    return out


def workload(client: LLMClient, tokens: Tokens, args: argparse.Namespace,
             metrics_url: str, mode: str) -> dict[str, float]:
    system = system_prompt(tokens, args.system_tokens)
    salt = f"bench-{mode}-{time.monotonic()}"  # a cold cache for each mode
    # The first conversation's first turn computes the system prompt: nothing to reuse yet.
    client.stream_collect(system + "<|im_start|>user\nHello.<|im_end|>\n", max_tokens=1,
                          end_id=-1, route="aggregated", cache_salt=salt)
    before = scrape(metrics_url)
    start = time.monotonic()
    with ThreadPoolExecutor(args.conversations) as pool:
        runs = list(pool.map(
            lambda topic: conversation(client, tokens, system, topic, args.turns,
                                       args.answer_tokens, salt),
            TOPICS[:args.conversations]))
    elapsed = time.monotonic() - start
    after = scrape(metrics_url)
    rows = [r for run in runs for r in run]
    hits = (metric_sum(after, "llm_prefix_cache_hits_total", model="worker")
            - metric_sum(before, "llm_prefix_cache_hits_total", model="worker"))
    reusable = sum(r[3] for r in rows)
    first = [r[1] for r in rows if r[0] == 0]
    later = [r[1] for r in rows if r[0] > 0]
    return {
        "ttft_p50_first": percentile(first, 0.5), "ttft_p95_first": percentile(first, 0.95),
        "ttft_p50_later": percentile(later, 0.5), "ttft_p95_later": percentile(later, 0.95),
        "tok_s": sum(r[2] for r in rows) / elapsed, "hit_rate": hits / reusable,
    }


def store_read(client: LLMClient, repo: Any, tokens: Tokens, n: int) -> tuple[float, float]:
    """TTFT of a prompt with an n-token prefix computed, and read from the store."""
    prefix = system_prompt(tokens, n)
    salt = f"store-{time.monotonic()}"

    def ttft(question: str) -> float:
        return client.stream_collect(prefix + question, max_tokens=1, end_id=-1,
                                     route="aggregated", cache_salt=salt).ttft

    computed = ttft("<|im_start|>user\nFirst?<|im_end|>\n")
    repo.restart("worker")  # new instance, empty pool; the kv_store model keeps its blocks
    return computed, ttft("<|im_start|>user\nSecond?<|im_end|>\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=DEFAULT_ENGINE_DIR)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--store-prefix-tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    tokens = Tokens(args.engine)
    with tempfile.TemporaryDirectory() as tmp:
        opts = ServerOptions(http_port=free_port(), grpc_port=free_port(),
                             metrics_port=free_port(), engine_dir=args.engine,
                             log_file=Path(tmp) / "triton.log")
        with TritonServer(opts) as server:
            server.wait_ready(progress=True)
            client, repo = LLMClient(opts.http_url), opts.repository()
            results = {}
            for mode, params in MODES.items():
                print(f"[prefix] {mode}: {args.conversations} conversations x {args.turns} "
                      f"turns, {args.system_tokens}-token system prompt", flush=True)
                with repo.reloaded("worker", **params):
                    results[mode] = workload(client, tokens, args, opts.metrics_url, mode)
            computed, from_store = store_read(client, repo, tokens, args.store_prefix_tokens)
    print(f"\n{'mode':<12} {'TTFT p50/p95 turn 1 (ms)':>26} {'TTFT p50/p95 turns 2+ (ms)':>28} "
          f"{'tok/s':>7} {'hit rate':>9}")
    for mode, r in results.items():
        print(f"{mode:<12} {r['ttft_p50_first'] * 1e3:>12.0f} / {r['ttft_p95_first'] * 1e3:<11.0f}"
              f" {r['ttft_p50_later'] * 1e3:>14.0f} / {r['ttft_p95_later'] * 1e3:<11.0f}"
              f" {r['tok_s']:>7.1f} {r['hit_rate']:>8.0%}")
    off = results["off"]["ttft_p50_later"]
    for mode in ("on", "on + store"):
        print(f"TTFT p50 of turns 2+: {off / results[mode]['ttft_p50_later']:.1f}x lower with "
              f"caching {mode} than off")
    print(f"{args.store_prefix_tokens}-token prefix: TTFT {computed * 1e3:.0f} ms computed, "
          f"{from_store * 1e3:.0f} ms read from the store ({computed / from_store:.1f}x faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
