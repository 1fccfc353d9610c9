#!/usr/bin/env python3
"""Decode step time of each model family against a Llama of the same width, in one run.

Builds a random-weight engine per family (models/registry.py) at one width (SmolLM2's: hidden
576, 9 heads, 3 KV heads, MLP 1536, its vocabulary; --layers layers): each family's own knobs
at that width (Qwen2's q/k/v biases, Qwen3's q/k norms, Mistral's and Gemma's windows, Gemma's
caps and GeGLU, Phi-4-mini's partial LongRoPE rotation; the mixture-of-experts families with 8
experts of half the MLP's width, top 2, DeepSeek's latent attention with a 256-wide latent, one
dense layer and a shared expert). Each engine then decodes --tokens tokens for 1 and for 8
prompts of --prompt-tokens tokens at once; the figure is the median time of a step in which
every sequence decodes (prompt steps left out), and the ratio is against the Llama's.

    python scripts/bench_families.py                 # every family, 8 layers
    python scripts/bench_families.py --families llama,qwen2,gemma3 --layers 30

Families are measured in turns (llama first and last, the ratio against the mean of the two), so
a machine that slows or speeds up during the run shows as a difference between the two Llamas.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from python_backends.config import EngineLimits
from python_backends.engine.builder import write_engine
from python_backends.engine.llm_engine import LLMEngine
from python_backends.params import SamplingParams

WIDTH: dict[str, Any] = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                             max_position_embeddings=2048, tie_word_embeddings=True,
                             eos_token_id=None)
MOE: dict[str, Any] = dict(num_experts_per_tok=2)
PARTIAL: dict[str, Any] = dict(partial_rotary_factor=0.75)  # Phi-4-mini's; taken, not declared


def configs(layers: int) -> dict[str, Callable[[], Any]]:
    import transformers as t

    w = {**WIDTH, "num_hidden_layers": layers}
    no_head = {k: v for k, v in w.items() if k != "head_dim"}
    return {
        "llama": lambda: t.LlamaConfig(**no_head),
        "mistral": lambda: t.MistralConfig(**no_head, sliding_window=128),
        "mixtral": lambda: t.MixtralConfig(**{**no_head, "intermediate_size": 768}, **MOE,
                                           num_local_experts=8, sliding_window=None),
        "qwen2": lambda: t.Qwen2Config(**no_head),
        "qwen3": lambda: t.Qwen3Config(**w),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**w, **MOE, num_experts=8,
                                              moe_intermediate_size=768, norm_topk_prob=True),
        "phi3": lambda: t.Phi3Config(**no_head, pad_token_id=0, **PARTIAL),
        "gemma2": lambda: t.Gemma2Config(**w, query_pre_attn_scalar=64, sliding_window=128),
        "gemma3": lambda: t.Gemma3TextConfig(**w, query_pre_attn_scalar=64, sliding_window=128),
        "deepseek_v3": lambda: t.DeepseekV3Config(
            **{**no_head, "num_key_value_heads": 9}, **MOE, n_routed_experts=8,
            moe_intermediate_size=768, n_group=4, topk_group=2, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32,
            qk_nope_head_dim=64, v_head_dim=64),
    }


def build(name: str, out: Path, layers: int, limits: EngineLimits) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(configs(layers)[name]()).eval()
    write_engine(hf, None, out, limits, "float32", "random", log=lambda _m: None)


def decode_step_ms(engine: LLMEngine, batch: int, prompt_tokens: int, tokens: int) -> float:
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(10, 40000, (prompt_tokens,), generator=g).tolist()
        engine.add_request(f"r{batch}-{i}", prompt, SamplingParams(max_tokens=tokens))
    times = []
    while engine.has_unfinished:
        decoding = bool(engine.scheduler.running) and not engine.scheduler.waiting and all(
            s.num_uncomputed_tokens == 1 for s in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(configs(1)))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    unknown = sorted(set(names) - set(configs(1)))
    if unknown:
        print(f"[bench_families] unknown families {unknown}; known: {sorted(configs(1))}",
              file=sys.stderr)
        return 2
    order = ["llama", *[n for n in names if n != "llama"], "llama"]
    limits = EngineLimits(max_seq_len=512, max_num_seqs=8, max_num_batched_tokens=1024)
    print(f"[bench_families] {cpu_name()}, torch threads {torch.get_num_threads()}, "
          f"{args.layers} layers, {args.prompt_tokens}-token prompts, {args.tokens} tokens")
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in order:
            out = Path(tmp) / name
            if not out.exists():
                print(f"[bench_families] building {name}", flush=True)
                build(name, out, args.layers, limits)
            engine = LLMEngine.from_engine_dir(out, num_kv_blocks=256)
            try:
                figures = tuple(decode_step_ms(engine, b, args.prompt_tokens, args.tokens)
                                for b in (1, 8))
            finally:
                engine.close()
            results.setdefault(name, []).append((figures[0], figures[1]))
            print(f"[bench_families] {name}: {figures[0]:.1f} ms at 1, {figures[1]:.1f} ms at 8",
                  flush=True)
    base = [statistics.mean(r[i] for r in results["llama"]) for i in (0, 1)]
    print("\n| family | step ms, 1 sequence | vs Llama | step ms, 8 sequences | vs Llama |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        one, eight = (statistics.mean(r[i] for r in runs) for i in (0, 1))
        print(f"| {name} | {one:.1f} | {one / base[0]:.2f}x | {eight:.1f} | "
              f"{eight / base[1]:.2f}x |")
    first, last = results["llama"]
    print(f"\nllama first / last run: {first[0]:.1f} / {last[0]:.1f} ms at 1, "
          f"{first[1]:.1f} / {last[1]:.1f} ms at 8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
