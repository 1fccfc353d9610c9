"""How fast any server could serve a workload with this engine's projections on this machine,
against how fast the engine serves it driven alone: a roofline measured, not looked up.

Two floors hold for every LLM server, whatever its serving path:
- arithmetic: every token of every prompt and every generated token but the last goes through
  every projection (2 FLOPs per weight), and every sampled token through the LM head;
- weight reads: a request of O output tokens needs O steps one after another (one for its prompt,
  which samples the first token, then one per later token), and a step reads every weight once.
  With C requests in flight, a level of n requests takes at least ceil(n / C) * O steps.
A level's time is at least the larger of the two, with the rates measured here with the engine's
own kernels: the projections of a prompt-sized batch (the arithmetic rate) and of one token (a
step's weight-read time). Attention, norms and everything else count as free, so the bound is
optimistic; `cores` > 1 assumes perfect scaling, so it is more optimistic still.

`step_bound` is tighter, still optimistic: a level's decode steps at the rate the projections
reach on that many rows (a few dozen rows run below the prompt-sized rate), plus decode
attention at its measured time per context slot with the KV read from memory, not cache (a
step's attention reads every sequence's whole context: at 32 sequences of a few hundred tokens
it is bound by memory bandwidth). The LM head, prompts' attention and the rest stay free.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from python_backends.engine.llm_engine import LLMEngine
from python_backends.models import kernels
from python_backends.models.attention import DecodeBatch, decode_attention
from python_backends.models.decoder import Attention, CausalLM
from python_backends.parallel.layers import Linear, pass_seconds
from python_backends.params import SamplingParams


@dataclass(frozen=True)
class Projections:
    """The dense projections of a model, as the engine computes them."""

    modules: tuple[Linear, ...]
    lm_head: Linear | None

    @classmethod
    def of(cls, model: CausalLM) -> Projections:
        if model.config.num_experts:
            raise ValueError("the roofline covers dense models; this one has experts")
        if model.ctx.layout.world_size > 1:
            raise ValueError("the roofline covers single-rank engines; this one has "
                             f"{model.ctx.layout.world_size} ranks")
        body = tuple(m for m in model.model.modules() if isinstance(m, Linear))
        return cls(body, model.lm_head)

    @property
    def flops_per_token(self) -> float:
        """Every projection but the LM head, for one token."""
        return 2.0 * sum(m.in_features * m.out_features for m in self.modules)

    @property
    def lm_head_flops(self) -> float:
        head = self.lm_head
        return 2.0 * head.in_features * head.out_features if head is not None else 0.0

    @property
    def weight_bytes(self) -> int:
        """What a step reads: int8 projections one byte per weight, the rest their dtype's."""
        total = 0
        for m in self.all():
            size = 1 if m.quantized is not None else m.input_dtype.itemsize
            total += m.in_features * m.out_features * size
        return total

    def all(self) -> tuple[Linear, ...]:
        return self.modules + ((self.lm_head,) if self.lm_head is not None else ())

    def run(self, rows: int, repeats: int, head: bool = True) -> float:
        """Seconds one pass of `rows` tokens through every projection (but the LM head, unless
        `head`) takes, as the engine computes them (best of `repeats`; layers.pass_seconds)."""
        return pass_seconds(self.all() if head else self.modules, rows, repeats)


@dataclass(frozen=True)
class Rates:
    """Measured on this process's torch threads."""

    flops_per_s: float  # the projections on `prompt_rows` tokens at once
    step_read_s: float  # one token through every projection: a step's weight-read floor
    prompt_rows: int
    fma_peak_flops_per_s: float | None = None  # one thread's float32 FMAs (kernels.fma_peak)

    def min_step_s(self, cores: int = 1) -> float:
        """The shortest step, so the shortest time between two tokens of one stream."""
        return self.step_read_s / cores


def measure(projections: Projections, prompt_rows: int = 512, repeats: int = 3) -> Rates:
    """On this process's torch threads only: native kernels' idle-CPU helper stays out."""
    flops = prompt_rows * (projections.flops_per_token + projections.lm_head_flops)
    with kernels.helper_off():
        return Rates(flops_per_s=flops / projections.run(prompt_rows, repeats),
                     step_read_s=projections.run(1, repeats), prompt_rows=prompt_rows,
                     fma_peak_flops_per_s=kernels.fma_peak_flops())


@dataclass(frozen=True)
class StepRates:
    """A decode step of `rows` sequences, measured on this process's torch threads: the rate of
    the projections but the LM head at that many rows, and decode attention's seconds for one
    row over one context slot, every layer, the KV read from memory."""

    rows: int
    body_flops_per_s: float
    attention_s_per_slot: float


def decode_attention_seconds(engine: LLMEngine, rows: int, context: int,
                             repeats: int = 3) -> float:
    """Seconds one decode step's attention takes for `rows` sequences of `context` tokens, every
    layer, as the engine computes it (attention.decode_attention), over contexts in
    blocks drawn at random from the engine's own KV pool (a long-running engine's sequences hold
    blocks anywhere in it): best of `repeats`, each pass over other blocks, so that the KV comes
    from memory as it does in a step. Raises ValueError for attention this does not model
    (latent, sliding windows, on a GPU) and where the pool holds too few blocks."""
    runner, cfg = engine.runner, engine.config.model
    if cfg.sliding_window or not all(type(a) is Attention
                                     for a in runner.model.attention_layers()):
        raise ValueError("decode attention is measured for full-context multi-head attention; "
                         "this model has latent attention or sliding windows")
    block = runner.block_size
    caches = runner.kv_caches
    if caches[0].device.type != "cpu":
        raise ValueError("decode attention is measured on CPU engines")
    per_row = -(-context // block)
    pool_blocks = caches[0].shape[1] // block
    if rows * per_row > pool_blocks:
        raise ValueError(f"{rows} contexts of {context} tokens need {rows * per_row} KV blocks; "
                         f"the engine has {pool_blocks}")
    q = torch.randn(rows, cfg.num_heads, cfg.head_dim, dtype=caches[0].dtype)
    scale = cfg.head_dim ** -0.5
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    with torch.inference_mode(), kernels.helper_off():
        for i in range(repeats + 1):
            blocks = torch.randperm(pool_blocks, generator=g)[: rows * per_row].view(rows, -1)
            slots = (blocks[:, :, None] * block + torch.arange(block)).view(rows, -1)
            d = DecodeBatch(torch.arange(rows), slots[:, :context].contiguous(),
                            torch.full((rows,), context))
            start = time.perf_counter()
            for cache in caches:
                decode_attention(q, cache, d, scale)
            if i:
                best = min(best, time.perf_counter() - start)
    return best


def measure_step(engine: LLMEngine, projections: Projections, rows: int, context: int,
                 repeats: int = 3) -> StepRates:
    """StepRates for decode steps of `rows` sequences of about `context` tokens each, on this
    process's torch threads only (the native kernels' idle-CPU helper stays out)."""
    with kernels.helper_off():
        body_s = projections.run(rows, repeats, head=False)
    attention_s = decode_attention_seconds(engine, rows, context, repeats)
    return StepRates(rows, rows * projections.flops_per_token / body_s,
                     attention_s / (rows * context))


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    requests: int

    def __post_init__(self) -> None:
        if min(self.prompt_tokens, self.output_tokens, self.concurrency, self.requests) < 1:
            raise ValueError(f"every part of a workload must be at least 1: {self}")

    def flops(self, projections: Projections) -> float:
        per_request = ((self.prompt_tokens + self.output_tokens - 1) * projections.flops_per_token
                       + self.output_tokens * projections.lm_head_flops)
        return self.requests * per_request

    @property
    def min_steps(self) -> int:
        return -(-self.requests // self.concurrency) * self.output_tokens

    @property
    def decode_slots(self) -> int:
        """Context slots the decode rows read: each request's token i (1 .. output_tokens - 1)
        attends over its prompt and the i tokens before it."""
        n = self.output_tokens - 1
        return self.requests * (n * self.prompt_tokens + n * (n + 1) // 2)

    @property
    def mean_decode_context(self) -> int:
        """A decode row's context, on average (at least 1)."""
        return max(1, self.prompt_tokens + self.output_tokens // 2)


@dataclass(frozen=True)
class Bound:
    """The fastest a level could go on `cores` cores."""

    cores: int
    compute_s: float  # the arithmetic at the measured rate(s)
    read_s: float  # the steps' weight reads
    output_tokens: int
    attention_s: float = 0.0  # decode attention's KV reads (step_bound)

    @property
    def seconds(self) -> float:
        return max(self.compute_s + self.attention_s, self.read_s)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def limit(self) -> str:
        if self.compute_s + self.attention_s < self.read_s:
            return "weight reads"
        return "arithmetic and decode attention" if self.attention_s else "arithmetic"


def bound(workload: Workload, projections: Projections, rates: Rates, cores: int = 1) -> Bound:
    return Bound(
        cores=cores,
        compute_s=workload.flops(projections) / (rates.flops_per_s * cores),
        read_s=workload.min_steps * rates.step_read_s / cores,
        output_tokens=workload.requests * workload.output_tokens,
    )


def step_bound(workload: Workload, projections: Projections, rates: Rates, step: StepRates,
               cores: int = 1) -> Bound:
    """The tighter bound (module docstring): prompts' projections at the prompt-sized rate, the
    decode rows' at `step`'s, decode attention at `step`'s time per slot; the LM head free."""
    w, body = workload, projections.flops_per_token
    prompt_s = w.requests * w.prompt_tokens * body / rates.flops_per_s
    decode_s = w.requests * (w.output_tokens - 1) * body / step.body_flops_per_s
    return dataclasses.replace(bound(w, projections, rates, cores),
                               compute_s=(prompt_s + decode_s) / cores,
                               attention_s=w.decode_slots * step.attention_s_per_slot / cores)


@dataclass(frozen=True)
class Driven:
    """The engine driven alone in this process: no server, no client."""

    output_tokens: int
    seconds: float
    steps: int
    phases: dict[str, float]  # the engine loop's seconds per phase (LLMEngine.step_seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps


def drive(engine: LLMEngine, prompts: list[list[int]], workload: Workload,
          max_s: float = 600.0) -> Driven:
    """Serve `prompts` (one per request) at `workload.concurrency`, each to exactly
    `workload.output_tokens` tokens (greedy, end ids ignored), as a server's clients would
    keep that many requests in flight. Raises TimeoutError past `max_s`."""
    if len(prompts) != workload.requests:
        raise ValueError(f"{len(prompts)} prompts for {workload.requests} requests")
    params = SamplingParams(max_tokens=workload.output_tokens)
    phases_before = dict(engine.step_seconds)
    queued = list(enumerate(prompts))
    in_flight = tokens = steps = 0
    start = time.perf_counter()
    while queued or in_flight:
        while queued and in_flight < workload.concurrency:
            i, prompt = queued.pop(0)
            engine.add_request(f"roofline-{id(prompts)}-{i}", prompt, params)
            in_flight += 1
        events = engine.step()
        steps += 1
        tokens += len(events)
        in_flight -= sum(e.finish_reason is not None for e in events)
        if time.perf_counter() - start > max_s:
            for s in engine.sequences():
                engine.abort(s.seq_id)
            raise TimeoutError(f"the level did not finish in {max_s:.0f} s")
    seconds = time.perf_counter() - start
    phases = {k: v - phases_before[k] for k, v in engine.step_seconds.items()}
    return Driven(tokens, seconds, steps, phases)


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of uniformly drawn token ids (ids below 100 left out: special tokens)."""
    g = torch.Generator().manual_seed(seed)
    low = min(100, vocab_size - 1)
    return torch.randint(low, vocab_size, (n, length), generator=g).tolist()


def summary(workload: Workload, driven: Driven, bounds: Sequence[Bound],
            step_bounds: Sequence[Bound] = ()) -> dict[str, Any]:
    return {
        "concurrency": workload.concurrency,
        "engine_tok_s": driven.tokens_per_s,
        "ms_per_step": driven.ms_per_step,
        **{f"bound_{b.cores}_cores_tok_s": b.tokens_per_s for b in bounds},
        **{f"limit_{b.cores}_cores": b.limit for b in bounds},
        **{f"step_bound_{b.cores}_cores_tok_s": b.tokens_per_s for b in step_bounds},
    }
