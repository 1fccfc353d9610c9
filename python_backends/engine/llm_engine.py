"""One engine instance: a model, its KV pool and its batch scheduler."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from python_backends.config import EngineConfig
from python_backends.engine import guided
from python_backends.engine.block_manager import BlockManager
from python_backends.engine.guided import GuideMatchers
from python_backends.engine.kv_handoff import KVHandoff, KVPull
from python_backends.engine.loader import kv_layout, load_model
from python_backends.engine.model_runner import rank_runner
from python_backends.engine.prefix_cache import KVTier, PrefixCache
from python_backends.engine.ranks import RankGroup, threads_per_rank
from python_backends.engine.sampler import SampleResult, sample
from python_backends.engine.scheduler import Scheduler, SchedulerOutput
from python_backends.engine.sequence import Sequence, Top
from python_backends.engine.speculative import SpeculationConfig
from python_backends.engine.waiting_queue import WaitingQueue
from python_backends.kv_transfer.layout import KVLayout
from python_backends.models import kernels
from python_backends.models.decoder import CausalLM
from python_backends.parallel.context import ParallelContext
from python_backends.parallel.placement import Placement
from python_backends.params import FinishReason, SamplingParams

# Where a step's time goes (LLMEngine.step_seconds): scheduling (with KV pulls), packing the
# step's inputs, the model's forward pass, sampling, updating sequences, and the engine loop's
# listener turning tokens into responses (engine_loop; the step's callers).
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "update", "respond")

# Makes the KV store tier behind an engine's pool, given the pool and its (whole-model) layout.
TierFactory = Callable[[torch.Tensor, KVLayout], KVTier]


@dataclass(frozen=True)
class TokenEvent:
    """One sequence's new token from one step."""

    seq_id: str
    token_id: int
    logprob: float | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    queue_time: float | None = None  # with a sequence's first token: seconds it waited
    prefill_time: float | None = None  # with its first token: first scheduled step to token
    decode_time: float | None = None  # with its last token: first token to last
    # A prefill-only sequence done with its prompt: the KV blocks it hands over (the receiver
    # owns them now and releases them with `LLMEngine.blocks.release`), holding `kv_tokens`.
    kv_blocks: tuple[int, ...] | None = None
    kv_tokens: int = 0
    # with params.top_log_probs: the likeliest alternatives (token id, log-probability)
    top: Top = ()


@dataclass(frozen=True)
class EngineStats:
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_size: int  # tokens per block: what a prefix hash covers (prefix_hash)
    step_tokens: int  # the most tokens one step computes (step_budget)
    num_running: int
    num_waiting: int
    num_preemptions: int  # since start
    num_prompt_tokens_computed: int  # since start: prompt positions this engine computed
    busy_seconds: float  # since start: time spent in steps that computed something
    running_by_priority: dict[int, int]
    waiting_by_priority: dict[int, int]
    prefix_cache_queries: int = 0  # since start: tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # since start: of those, found (in the pool or the KV store)
    kv_store_hits: int = 0  # since start: blocks read from the KV store
    kv_store_misses: int = 0  # since start: blocks the store listed but could not give
    kv_store_read_bytes: int = 0
    kv_store_written_bytes: int = 0
    ranks_alive: int = 1  # of the engine's parallel group; fewer than ranks_total: unhealthy
    ranks_total: int = 1
    devices: tuple[str, ...] = ("cpu",)  # rank r's device
    step_seconds: tuple[tuple[str, float], ...] = ()  # since start: by STEP_PHASES
    kernel_chunks: int = 0  # since start, rank 0's process: native-kernel work, in chunks
    helper_chunks: int = 0  # of those, computed by the idle-CPU helper (models.kernels)
    helper_taken_back: int = 0  # chunks the helper had taken that the engine thread took back
    helper_boosted: int = 0  # heavy jobs (prompts') the helper worked on at normal priority
    draft_tokens: int = 0  # since start: speculative tokens computed (engine.speculative)
    draft_tokens_accepted: int = 0  # of those, confirmed by the model and kept


# The most rows a decode step captured as a CUDA graph has: beyond it a step computes long
# enough that launching its kernels one by one costs little.
MAX_GRAPH_ROWS = 512


def step_budget(built: int, step_tokens: int = 0) -> int:
    """Tokens one step computes at most: `step_tokens` (0: the engine's own limit, `built`),
    never more than the engine was built for. On a CPU a smaller budget shortens the steps that
    running sequences wait through but did not serve faster (docs/engines.md, "The step's token
    budget")."""
    if step_tokens < 0:
        raise ValueError(f"step_tokens must be at least 0, got {step_tokens}")
    return min(built, step_tokens or built)


def graph_rows(config: EngineConfig, speculation: SpeculationConfig | None) -> int:
    """The largest decode step of an engine: every running sequence with its longest draft,
    within one step's token budget."""
    drafts = speculation.num_tokens if speculation is not None else 0
    limits = config.limits
    return min(limits.max_num_seqs * (1 + drafts), limits.max_num_batched_tokens,
               MAX_GRAPH_ROWS)


class LLMEngine:
    """One engine instance: add sequences, step, abort, report stats. The KV handoff between
    instances is a component of its own (`handoff`)."""

    def __init__(
        self, config: EngineConfig, model: CausalLM, num_kv_blocks: int,
        enable_chunked_prefill: bool = True, waiting: WaitingQueue | None = None,
        kv_pool: torch.Tensor | None = None, group: RankGroup | None = None,
        enable_prefix_caching: bool = True, kv_tier: TierFactory | None = None,
        speculation: SpeculationConfig | None = None, guides: GuideMatchers | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        """`model`: rank 0's. `kv_pool`: the pool KV transports see (see KVHandoff), a tensor of
        the whole-model layout. `group`: ranks 1..N-1 of a multi-rank engine, closed by
        `close`. `kv_tier`: makes the KV store tier behind the prefix cache from the pool and
        its layout (single-rank engines only: a multi-rank pool is split across processes).
        `speculation`: drafts for greedy decoding (engine.speculative; default off).
        `guides`: matchers for structured outputs (default: none; a guided request is then
        refused as the engine has no tokenizer). `cuda_graphs`: decode steps replay CUDA graphs
        where the engine is on a GPU and its model can be captured (engine.cuda_graphs)."""
        self.config = config
        self.guides = guides or GuideMatchers(None, config.model.vocab_size,
                                              config.tokenizer.eos_token_ids)
        self.device = model.ctx.device
        self.devices = group.devices if group is not None else [self.device]  # rank r's
        whole = kv_layout(config, num_kv_blocks, whole=True)
        if kv_pool is not None and kv_pool.shape != whole.shape:
            raise ValueError(f"KV pool shape {tuple(kv_pool.shape)} != {whole.shape}")
        self.runner = rank_runner(config, model, num_kv_blocks,
                                  kv_pool if group is None else None, group,
                                  graph_rows(config, speculation) if cuda_graphs else 0)
        self.tier = (kv_tier(self.runner.kv_pool, whole)
                     if kv_tier is not None and group is None else None)
        self.blocks = BlockManager(num_kv_blocks, config.limits.block_size,
                                   self.tier.write if self.tier is not None else None)
        self.prefix = PrefixCache(self.blocks, enable_prefix_caching, self.tier)
        self.scheduler = Scheduler(config.limits, self.blocks, enable_chunked_prefill, waiting,
                                   self.prefix, speculation, config.model.window_everywhere)
        self.handoff = KVHandoff(whole, self.runner, self.blocks, self.scheduler, kv_pool)
        self.busy_seconds = 0.0
        self.step_seconds = dict.fromkeys(STEP_PHASES, 0.0)

    @classmethod
    def from_engine_dir(
        cls, engine_dir: str | Path, num_kv_blocks: int, enable_chunked_prefill: bool = True,
        waiting: WaitingQueue | None = None,
        kv_pool: Callable[[KVLayout, torch.device], torch.Tensor] | None = None,
        placement: Placement | None = None, enable_prefix_caching: bool = True,
        kv_tier: TierFactory | None = None, cpu_threads: int = 0,
        speculation: SpeculationConfig | None = None, cuda_graphs: bool = True,
        step_tokens: int = 0,
    ) -> LLMEngine:
        """`kv_pool`: makes the pool for the engine's layout on rank 0's device (default: plain
        memory there). `placement`: where the instance's ranks compute (default: the CPU).
        `cpu_threads`: torch threads for all its ranks together (0: every core but one; see
        ranks.threads_per_rank); set for the whole process. `step_tokens`: the most tokens one
        step computes (`step_budget`; 0: the engine's own limit). The rest as in `__init__`."""
        config = EngineConfig.load(engine_dir)
        devices = (placement or Placement()).devices(config.parallel.world_size)
        budget = step_budget(config.limits.max_num_batched_tokens, step_tokens)
        config = replace(config, limits=replace(config.limits, max_num_batched_tokens=budget))
        threads = threads_per_rank(config.parallel.world_size, cpu_threads)
        torch.set_num_threads(threads)
        group = None
        if config.parallel.world_size > 1:
            group = RankGroup(engine_dir, config, num_kv_blocks, devices, threads=threads)
        try:
            ctx = group.ctx if group else ParallelContext(config.parallel, device=devices[0])
            model = load_model(engine_dir, config, ctx)
            if group is not None:
                group.wait_ready()
            whole = kv_layout(config, num_kv_blocks, whole=True)
            pool = kv_pool(whole, devices[0]) if kv_pool is not None else None
            guides = GuideMatchers(Path(engine_dir), config.model.vocab_size,
                                   config.tokenizer.eos_token_ids)
            return cls(config, model, num_kv_blocks, enable_chunked_prefill, waiting, pool, group,
                       enable_prefix_caching, kv_tier, speculation, guides, cuda_graphs)
        except BaseException:
            if group is not None:
                group.close()
            raise

    def close(self) -> None:
        """Stop the engine's other ranks, if any, and let go of the KV store (idempotent)."""
        if self.runner.group is not None:
            self.runner.group.close()
        if self.tier is not None:
            self.tier.close()

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; a ValueError if it can never fit or follow its guide."""
        self.scheduler.check_fits(seq)  # before the guide: a matcher is not free to make
        self.guides.attach(seq)
        self.scheduler.add(seq)

    def add_handoff(self, seq: Sequence, num_kv_tokens: int, pull: KVPull) -> None:
        """A sequence whose first `num_kv_tokens` tokens' KV another instance computed, pulled
        by `pull` (KVHandoff.add); a ValueError as for `add`."""
        self.guides.attach(seq)
        self.handoff.add(seq, num_kv_tokens, pull)

    def add_request(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
        priority: int = 0, tenant: str = "default", prefill_only: bool = False,
    ) -> Sequence:
        """`add` a sequence made of these parts. `prefill_only`: stop after the first token and
        keep the blocks (see Sequence.prefill_only); the caller releases them with
        `blocks.release`."""
        seq = Sequence(seq_id, list(prompt_ids), params, priority=priority, tenant=tenant,
                       prefill_only=prefill_only)
        self.add(seq)
        return seq

    def abort(self, seq_id: str) -> Sequence | None:
        return self.handoff.abort(seq_id) or self.scheduler.abort(seq_id)

    def sequences(self) -> list[Sequence]:
        """Every unfinished sequence: running, waiting, or imported and not yet scheduled."""
        return [*self.scheduler.running, *self.scheduler.waiting,
                *(i.seq for i in self.handoff.pending)]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.handoff.pending) or self.scheduler.has_unfinished

    def step(self) -> list[TokenEvent]:
        """schedule -> run -> sample -> update; returns one event per sampled sequence."""
        start = time.perf_counter()
        self.handoff.pull()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        self.step_seconds["schedule"] += time.perf_counter() - start
        try:
            return self._run(out)
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _run(self, out: SchedulerOutput) -> list[TokenEvent]:
        times, t0 = self.step_seconds, time.perf_counter()
        prepared = self.runner.prepare_seconds
        masks = guided.start_masks([(s.seq, s.draft) for s in out.scheduled if s.samples],
                                   self.config.model.vocab_size)
        head, sampling = self.runner.run(out)
        t1 = time.perf_counter()
        prepare = self.runner.prepare_seconds - prepared
        times["prepare"] += prepare
        times["forward"] += t1 - t0 - prepare
        result = (sample(sampling, head, masks.result() if masks else None) if sampling
                  else SampleResult([], None))
        t2 = time.perf_counter()
        times["sample"] += t2 - t1
        events = [self._event(s, s.num_output_tokens - drawn + k)
                  for s, drawn in self.scheduler.update(out, result) for k in range(1, drawn + 1)]
        self.handoff.export([b for e in events if e.kv_blocks for b in e.kv_blocks])
        times["update"] += time.perf_counter() - t2
        return events

    @staticmethod
    def _event(s: Sequence, n: int) -> TokenEvent:
        """The event of `s`'s `n`-th output token (a step can draw several: speculation)."""
        last = n == s.num_output_tokens
        handed_over = last and s.prefill_only and s.is_finished and s.finish_reason is None
        prefill_time = decode_time = None
        if n == 1 and s.first_token_time and s.queue_time is not None:
            prefill_time = s.first_token_time - s.arrival_time - s.queue_time
        if last and s.finish_reason is not None and s.first_token_time is not None:
            decode_time = time.monotonic() - s.first_token_time
        event = TokenEvent(
            seq_id=s.seq_id,
            token_id=s.output_ids[n - 1],
            logprob=s.output_logprobs[n - 1] if s.params.return_log_probs else None,
            finish_reason=s.finish_reason if last else None,
            num_prompt_tokens=s.num_prompt_tokens,
            num_output_tokens=n,
            queue_time=s.queue_time if n == 1 else None,
            prefill_time=prefill_time,
            decode_time=decode_time,
            kv_blocks=tuple(s.block_table) if handed_over else None,
            kv_tokens=s.num_computed_tokens if handed_over else 0,
            top=s.output_top[n - 1] if s.params.top_log_probs else (),
        )
        if handed_over:
            s.block_table = []
        return event

    def stats(self) -> EngineStats:
        helper = kernels.helper_stats()
        return EngineStats(
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
            kv_block_size=self.blocks.block_size,
            step_tokens=self.scheduler.limits.max_num_batched_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.handoff.pending),
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            busy_seconds=self.busy_seconds,
            running_by_priority=dict(Counter(s.priority for s in self.scheduler.running)),
            waiting_by_priority=dict(Counter(s.priority for s in self.scheduler.waiting)),
            prefix_cache_queries=self.prefix.num_queries,
            prefix_cache_hits=self.prefix.num_hits,
            kv_store_hits=self.prefix.num_tier_hits,
            kv_store_misses=self.prefix.num_tier_misses,
            kv_store_read_bytes=self.tier.bytes_read if self.tier else 0,
            kv_store_written_bytes=self.tier.bytes_written if self.tier else 0,
            ranks_alive=self.runner.group.ranks_alive if self.runner.group else 1,
            ranks_total=self.config.parallel.world_size,
            devices=tuple(str(d) for d in self.devices),
            step_seconds=tuple(self.step_seconds.items()),
            kernel_chunks=helper.chunks,
            helper_chunks=helper.helped,
            helper_taken_back=helper.taken_back,
            helper_boosted=helper.boosted,
            draft_tokens=self.scheduler.num_draft_tokens,
            draft_tokens_accepted=self.scheduler.num_accepted_tokens,
        )
