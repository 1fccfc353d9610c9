#!/usr/bin/env python3
"""Prompt-lookup drafting off, fixed and adaptive, on the chat workload and on a synthetic one.

The default engine driven alone (no server), --concurrency sequences at a time, greedy:
- chat: scripts/data/chat-prompts.jsonl through the model's chat template (follow-ups with
  their whole conversation), each to its end token or --chat-max-tokens;
- synthetic: prompts of --prompt-tokens random token ids, --output-tokens each, the end token
  ignored (vLLM's `random` dataset's shape).
Each round runs every mode on both workloads (off: no drafts; fixed: every draft as long as a
match allows; adaptive: the default, engine.speculative), the modes' order rotated per round.
Prints output tokens/s, the draft acceptance rate, and each mode's rate over drafting off;
and, since timings move several percent between runs on a shared machine, what a mode changed
that does not move: the engine's steps, and the rows its refused draft tokens took.

    python scripts/bench_drafting.py
    python scripts/bench_drafting.py --concurrency 8 --requests 48 --rounds 3
    python scripts/bench_drafting.py --concurrency 32 --requests 64 --modes off,adaptive
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from python_backends.config import DEFAULT_ENGINE_DIR, PROJECT_ROOT
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.speculative import SpeculationConfig
from python_backends.params import SamplingParams
from python_backends.procfs import cpu_description

CHAT = PROJECT_ROOT / "scripts" / "data" / "chat-prompts.jsonl"
MODES = {"off": SpeculationConfig(0), "fixed": SpeculationConfig(4, adaptive=False),
         "adaptive": SpeculationConfig(4)}


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in CHAT.read_text().splitlines()][:n]
    texts = [tokenizer.apply_chat_template(
        r.get("messages") or [{"role": "user", "content": r["prompt"]}],
        add_generation_prompt=True, tokenize=False) for r in rows]
    return [list(tokenizer(t)["input_ids"]) for t in texts]


@dataclass(frozen=True)
class Run:
    rate: float  # output tokens/s
    tokens: int  # output tokens
    steps: int
    drafted: int  # draft tokens computed
    kept: int  # of those, kept

    @property
    def acceptance(self) -> float | None:
        return self.kept / self.drafted if self.drafted else None

    @property
    def refused(self) -> int:
        """Rows computed for draft tokens that were refused."""
        return self.drafted - self.kept


def run(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int,
        end_ids: tuple[int, ...]) -> Run:
    params = SamplingParams(max_tokens=max_tokens, end_ids=end_ids)
    todo = list(enumerate(prompts))
    active: dict[int, Any] = {}
    tokens = steps = 0
    s0 = engine.stats()
    start = time.perf_counter()
    while todo or active:
        while todo and len(active) < concurrency:
            i, p = todo.pop(0)
            active[i] = engine.add_request(f"{i}-{time.time()}", p, params)
        engine.step()
        steps += 1
        for i, seq in list(active.items()):
            if seq.is_finished:
                tokens += seq.num_output_tokens
                del active[i]
    elapsed = time.perf_counter() - start
    s1 = engine.stats()
    return Run(tokens / elapsed, tokens, steps, s1.draft_tokens - s0.draft_tokens,
               s1.draft_tokens_accepted - s0.draft_tokens_accepted)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--chat-max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated, from: " + ", ".join(MODES) + " (default: all)")
    args = ap.parse_args(argv)
    names = args.modes.split(",")
    if "off" not in names or not set(names) <= set(MODES):
        ap.error(f"--modes: need off and any of {', '.join(MODES)}, got {args.modes!r}")
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_ENGINE_DIR))
    g = torch.Generator().manual_seed(0)
    engine = LLMEngine.from_engine_dir(DEFAULT_ENGINE_DIR, num_kv_blocks=1024,
                                       enable_prefix_caching=False)
    vocab = engine.config.model.vocab_size
    eos = engine.config.tokenizer.eos_token_ids
    workloads = {
        "chat": (chat_prompts(tokenizer, args.requests), args.chat_max_tokens, eos),
        "synthetic": ([torch.randint(100, vocab, (args.prompt_tokens,), generator=g).tolist()
                       for _ in range(args.requests)], args.output_tokens, ()),
    }
    print(f"[bench_drafting] CPU {cpu_description()}; concurrency {args.concurrency}, "
          f"{args.requests} requests per run", flush=True)
    results: dict[tuple[str, str], list[Run]] = {}
    try:
        run(engine, workloads["chat"][0][:2], 2, 8, eos)  # warm up
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for workload, (prompts, max_tokens, end_ids) in workloads.items():
                for mode in order:
                    engine.scheduler.speculation = MODES[mode]
                    out = run(engine, prompts, args.concurrency, max_tokens, end_ids)
                    results.setdefault((workload, mode), []).append(out)
                    acc = "-" if out.acceptance is None else f"{100 * out.acceptance:.0f}%"
                    print(f"[bench_drafting] round {r + 1} {workload:<9} {mode:<8} "
                          f"{out.rate:7.1f} tok/s ({out.tokens} tokens, {out.steps} steps, "
                          f"{out.refused} rows refused), acceptance {acc}", flush=True)
    finally:
        engine.close()
    print(f"\n{'workload':<10}{'mode':<10}{'tok/s':>8}{'x off':>8}{'acceptance':>12}"
          f"{'steps':>8}{'refused':>9}")
    for workload in workloads:
        off = statistics.median(x.rate for x in results[(workload, "off")])
        for mode in names:
            runs = results[(workload, mode)]
            rate = statistics.median(x.rate for x in runs)
            accs = [a for x in runs if (a := x.acceptance) is not None]
            acc = f"{100 * statistics.median(accs):.0f}%" if accs else "-"
            # the same in every round: the steps and drafts do not depend on timing
            print(f"{workload:<10}{mode:<10}{rate:>8.1f}{rate / off:>8.2f}{acc:>12}"
                  f"{runs[-1].steps:>8}{runs[-1].refused:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
