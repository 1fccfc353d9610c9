#!/usr/bin/env python3
"""Output tokens/s with a JSON-schema guide on every request against none, in one run.

The default engine driven alone (no server): --requests chat prompts asking for a person as
JSON, --concurrency at a time, greedy; once with `response_format`'s schema on every request
(engine/guided.py), each to the end of its JSON or --max-tokens, then without, each request
generating exactly as many tokens as its guided run did (the end token ignored), so both do
the same work; in turns, --rounds rounds. Prints output tokens/s of each and the ratio, and
the grammar's share: filling the token masks (on a worker thread, while the forward pass
computes), applying them, and what sampling costs the engine thread beyond an unguided step
(feeding each token to its matcher is left out: microseconds).

    python scripts/bench_structured.py
    python scripts/bench_structured.py --concurrency 8 --requests 32 --rounds 2
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

from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.engine import guided, sampler
from python_backends.engine.llm_engine import LLMEngine
from python_backends.engine.sequence import Sequence
from python_backends.params import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24},
                         "hobbies": {"type": "array", "maxItems": 3,
                                     "items": {"type": "string", "maxLength": 16}}}}
FILL_SECONDS = [0.0]  # filling guided rows' masks (a worker thread, beside the forward pass)
APPLY_SECONDS = [0.0]  # applying them on the engine thread (with any row filled late)
_fill, _apply = guided.allowed_tokens, sampler.mask_logits


def timed_fill(rows: list[tuple[Sequence, tuple[int, ...]]], vocab: int) -> guided.Masks:
    start = time.perf_counter()
    try:
        return _fill(rows, vocab)
    finally:
        FILL_SECONDS[0] += time.perf_counter() - start


def timed_apply(seqs: list[Sequence], logits: torch.Tensor,
                masks: guided.Masks | None = None) -> None:
    start = time.perf_counter()
    _apply(seqs, logits, masks)
    APPLY_SECONDS[0] += time.perf_counter() - start


@dataclass
class Run:
    rate: float  # output tokens/s
    lengths: list[int]  # each request's output tokens
    busy: float  # engine seconds
    steps: list[float]  # the times of steps in which `concurrency` sequences all decoded
    sample: float  # engine seconds in sampling (guided: waiting for and applying masks)


def run(engine: LLMEngine, prompts: list[list[int]], concurrency: int,
        max_tokens: list[int], guide: bool) -> Run:
    """Guided: to the end of the JSON (or max_tokens); free: exactly max_tokens per request,
    the end token ignored, so both runs produce the same tokens from the same prompts."""
    eos = engine.config.tokenizer.eos_token_ids
    todo = list(enumerate(prompts))
    active: dict[int, Any] = {}
    lengths = [0] * len(prompts)
    busy, sample_s, steps = engine.busy_seconds, engine.step_seconds["sample"], []
    start = time.perf_counter()
    while todo or active:
        while todo and len(active) < concurrency:
            i, p = todo.pop(0)
            params = SamplingParams(max_tokens=max_tokens[i], end_ids=eos if guide else (),
                                    guide_type="json_schema" if guide else "",
                                    guide=json.dumps(SCHEMA) if guide else "")
            active[i] = engine.add_request(f"{guide}-{i}-{time.time()}", p, params)
        running = engine.scheduler.running
        full = (len(running) == concurrency and not engine.scheduler.waiting
                and all(s.num_uncomputed_tokens == 1 for s in running))
        step_start = time.perf_counter()
        engine.step()
        if full:
            steps.append(time.perf_counter() - step_start)
        for i, seq in list(active.items()):
            if seq.is_finished:
                lengths[i] = seq.num_output_tokens
                del active[i]
    return Run(sum(lengths) / (time.perf_counter() - start), lengths,
               engine.busy_seconds - busy, steps, engine.step_seconds["sample"] - sample_s)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    guided.allowed_tokens = timed_fill
    sampler.mask_logits = timed_apply
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_ENGINE_DIR))
    names = ["Ada", "Bo", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana"]
    prompts = []
    for i in range(args.requests):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe a person called {names[i % 8]} (number "
                                         f"{i}) as JSON: name, age, city and hobbies."}],
            add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer(text)["input_ids"]))
    engine = LLMEngine.from_engine_dir(DEFAULT_ENGINE_DIR, num_kv_blocks=512,
                                       enable_prefix_caching=False)
    runs: dict[bool, list[Run]] = {True: [], False: []}
    fill = apply = 0.0
    try:
        run(engine, prompts[:2], 2, [8, 8], True)  # warm up: tokenizer, kernels, first matcher
        for r in range(args.rounds):
            fill0, apply0 = FILL_SECONDS[0], APPLY_SECONDS[0]
            g = run(engine, prompts, args.concurrency, [args.max_tokens] * len(prompts), True)
            fill += FILL_SECONDS[0] - fill0
            apply += APPLY_SECONDS[0] - apply0
            f = run(engine, prompts, args.concurrency, g.lengths, False)
            runs[True].append(g)
            runs[False].append(f)
            for name, x in (("schema", g), ("free", f)):
                print(f"[bench_structured] round {r + 1} {name}: {x.rate:.1f} output tok/s "
                      f"({sum(x.lengths)} tokens), decode step of {args.concurrency}: "
                      f"{1e3 * statistics.median(x.steps):.1f} ms", flush=True)
    finally:
        engine.close()
    g_rate = statistics.median(x.rate for x in runs[True])
    f_rate = statistics.median(x.rate for x in runs[False])
    busy = sum(x.busy for x in runs[True])
    tokens = sum(sum(x.lengths) for x in runs[True])
    gs = statistics.median(t for x in runs[True] for t in x.steps)
    fs = statistics.median(t for x in runs[False] for t in x.steps)
    extra = sum(x.sample for x in runs[True]) - sum(x.sample for x in runs[False])
    print(f"\nconcurrency {args.concurrency}, the same {tokens // args.rounds} output tokens "
          f"per run: schema {g_rate:.1f} tok/s, free {f_rate:.1f} tok/s (ratio "
          f"{g_rate / f_rate:.2f}); decode step of {args.concurrency} sequences: schema "
          f"{1e3 * gs:.1f} ms, free {1e3 * fs:.1f} ms (ratio {fs / gs:.2f} in tokens/s)")
    print(f"grammar: masks filled beside the forward pass {100 * fill / busy:.1f}% of the "
          f"guided runs' engine time ({1e3 * fill / tokens:.2f} ms per token); on the engine "
          f"thread, applying them {100 * apply / busy:.1f}%, and sampling cost "
          f"{1e3 * extra / tokens:.2f} ms per token more than unguided "
          f"({100 * extra / busy:.1f}% of the engine time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
