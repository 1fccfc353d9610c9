#!/usr/bin/env python3
"""How much an engine built with a faster dtype departs from the float32 engine of the same
model: greedy agreement on held-out prompts and the perplexity difference on a text.

    python scripts/build_engine.py --dtype bfloat16 --output engines/smollm2-bf16
    python scripts/bench_quality.py --engine engines/smollm2-bf16

Prompts are windows of `--text` (default: scripts/data/quality-text.txt, plain English prose
written for this, kept unchanged so figures stay comparable):
each engine continues every prompt greedily for `--tokens` tokens in one batch, and the script
counts continuations identical to the reference's and the mean length of their common prefix.
Perplexity is each engine's over the whole text, in windows of `--window` tokens. Both engines
run in this process, one after the other, on the CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from python_backends.config import DEFAULT_ENGINE_DIR, PROJECT_ROOT
from python_backends.engine.llm_engine import LLMEngine
from python_backends.models.attention import AttentionMetadata
from python_backends.params import SamplingParams


def prompts_of(ids: list[int], n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens spread evenly over the text."""
    stride = max(1, (len(ids) - length) // max(1, n))
    return [ids[i * stride: i * stride + length] for i in range(n)]


def greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, end_ids=())
    seqs = [engine.add_request(f"q{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished:
        engine.step()
    return [list(s.output_ids) for s in seqs]


@torch.inference_mode()
def perplexity(engine: LLMEngine, ids: list[int], window: int) -> float:
    """exp(mean NLL) of each token given the tokens before it in its window."""
    model, device = engine.runner.model, engine.device
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start: start + window + 1]
        n = len(chunk) - 1
        if n < 1:
            break
        meta = AttentionMetadata.one_prompt(n).to(device)
        logits = model(torch.tensor(chunk[:n], device=device), meta)
        target = torch.tensor(chunk[1:], device=device)
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        count += n
    return math.exp(nll / count)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True, help="the engine to judge")
    ap.add_argument("--reference", type=Path, default=DEFAULT_ENGINE_DIR,
                    help="the float32 engine of the same model")
    ap.add_argument("--text", type=Path,
                    default=PROJECT_ROOT / "scripts" / "data" / "quality-text.txt")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--window", type=int, default=512, help="perplexity window (tokens)")
    args = ap.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(str(args.reference))
    ids = tokenizer(args.text.read_text(), add_special_tokens=False)["input_ids"]
    prompts = prompts_of(ids, args.prompts, args.prompt_tokens)
    results = {}
    for name, path in (("reference", args.reference), ("engine", args.engine)):
        start = time.perf_counter()
        engine = LLMEngine.from_engine_dir(path, num_kv_blocks=1024,
                                           enable_prefix_caching=False)
        outputs = greedy(engine, prompts, args.tokens)
        ppl = perplexity(engine, ids, args.window)
        kind = engine.config.dtype + (f", {engine.config.weights} weights"
                                      if engine.config.weights else "")
        results[name] = (outputs, ppl, kind)
        engine.close()
        print(f"[quality] {path} ({kind}): perplexity {ppl:.3f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    ref, eng = results["reference"], results["engine"]
    same = sum(a == b for a, b in zip(ref[0], eng[0], strict=True))
    prefix = sum(common_prefix(a, b) for a, b in zip(ref[0], eng[0], strict=True))
    print(f"\n{eng[2]} against {ref[2]} on {args.text.name} ({len(ids)} tokens):")
    print(f"  greedy agreement: {same}/{len(prompts)} continuations of {args.tokens} tokens "
          f"identical; mean common prefix {prefix / len(prompts):.1f} tokens")
    print(f"  perplexity: {eng[1]:.3f} against {ref[1]:.3f} "
          f"({100 * (eng[1] / ref[1] - 1):+.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
