#!/usr/bin/env python3
"""Output tokens/s with a JSON-schema guide on every request against none, in one run.

The default engine driven alone (no server): --requests chat prompts asking for a person as
JSON, --concurrency at a time, greedy, each to its end token or --max-tokens; once with
`response_format`'s schema on every request (engine/guided.py), once without, in turns
(guided, free, guided, free: --rounds rounds). Prints output tokens/s of each, the ratio, and
the share of the guided runs' engine time spent filling and applying the grammar's token masks
(guided.mask_logits; feeding each token to its matcher is left out: microseconds).

    python scripts/bench_structured.py
    python scripts/bench_structured.py --concurrency 8 --requests 32 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.engine import guided, sampler
from python_backends.engine.llm_engine import LLMEngine
from python_backends.params import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24},
                         "hobbies": {"type": "array", "maxItems": 3,
                                     "items": {"type": "string", "maxLength": 16}}}}
MASK_SECONDS = [0.0]


def timed_mask(seqs: list[Any], logits: Any) -> None:
    start = time.perf_counter()
    guided.mask_logits(seqs, logits)
    MASK_SECONDS[0] += time.perf_counter() - start


def run(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int,
        guide: bool) -> tuple[float, int, float, list[float]]:
    """(output tokens/s, output tokens, engine busy seconds, the times of steps in which
    `concurrency` sequences all decoded)."""
    params = SamplingParams(max_tokens=max_tokens, end_ids=engine.config.tokenizer.eos_token_ids,
                            guide_type="json_schema" if guide else "",
                            guide=json.dumps(SCHEMA) if guide else "")
    todo = list(enumerate(prompts))
    active: dict[str, Any] = {}
    tokens, busy, steps = 0, engine.busy_seconds, []
    start = time.perf_counter()
    while todo or active:
        while todo and len(active) < concurrency:
            i, p = todo.pop(0)
            active[str(i)] = engine.add_request(f"{guide}-{i}", p, params)
        running = engine.scheduler.running
        full = (len(running) == concurrency and not engine.scheduler.waiting
                and all(s.num_uncomputed_tokens == 1 for s in running))
        step_start = time.perf_counter()
        engine.step()
        if full:
            steps.append(time.perf_counter() - step_start)
        for key, seq in list(active.items()):
            if seq.is_finished:
                tokens += seq.num_output_tokens
                del active[key]
    return (tokens / (time.perf_counter() - start), tokens, engine.busy_seconds - busy,
            steps)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    sampler.mask_logits = timed_mask
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
    results: dict[bool, list[tuple[float, int, float, list[float]]]] = {True: [], False: []}
    mask = 0.0
    try:
        run(engine, prompts[:2], 2, 8, True)  # warm up: tokenizer, kernels, first matcher
        for r in range(args.rounds):
            for guide in (True, False):
                before = MASK_SECONDS[0]
                results[guide].append(run(engine, prompts, args.concurrency, args.max_tokens,
                                          guide))
                if guide:
                    mask += MASK_SECONDS[0] - before
                rate, n, _, steps = results[guide][-1]
                print(f"[bench_structured] round {r + 1} {'schema' if guide else 'free'}: "
                      f"{rate:.1f} output tok/s ({n} tokens), decode step of "
                      f"{args.concurrency}: {1e3 * statistics.median(steps):.1f} ms", flush=True)
    finally:
        engine.close()
    g = statistics.median(x[0] for x in results[True])
    f = statistics.median(x[0] for x in results[False])
    busy = sum(x[2] for x in results[True])
    gs = statistics.median(t for x in results[True] for t in x[3])
    fs = statistics.median(t for x in results[False] for t in x[3])
    print(f"\nconcurrency {args.concurrency}: schema {g:.1f} tok/s, free {f:.1f} tok/s "
          f"(ratio {g / f:.2f}; guided outputs end sooner, so more of their time is prompts); "
          f"decode step of {args.concurrency} sequences: schema {1e3 * gs:.1f} ms, free "
          f"{1e3 * fs:.1f} ms (ratio {fs / gs:.2f} in tokens/s); token masks "
          f"{100 * mask / busy:.1f}% of the guided runs' engine time "
          f"({1e3 * mask / sum(x[1] for x in results[True]):.2f} ms per token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
