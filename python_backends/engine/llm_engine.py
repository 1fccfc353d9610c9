"""One engine instance: a model, its KV pool and its batch scheduler."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from python_backends.config import EngineConfig
from python_backends.engine.block_manager import BlockManager
from python_backends.engine.loader import load_model
from python_backends.engine.model_runner import ModelRunner
from python_backends.engine.params import FinishReason, SamplingParams
from python_backends.engine.placement import Placement
from python_backends.engine.sampler import SampleResult, sample
from python_backends.engine.scheduler import Scheduler, SchedulerOutput
from python_backends.engine.sequence import Sequence, SequenceStatus
from python_backends.engine.waiting_queue import WaitingQueue
from python_backends.kv_transfer.layout import KVLayout, allocate_pool
from python_backends.models.llama import LlamaForCausalLM
from python_backends.parallel.context import ParallelContext
from python_backends.parallel.group import RankGroup

# Copies a handed-off sequence's KV into the given local blocks; False: not possible (recompute).
KVFetch = Callable[[list[int]], bool]


@dataclass
class _Handoff:
    seq: Sequence
    num_kv_tokens: int
    fetch: KVFetch


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


@dataclass(frozen=True)
class EngineStats:
    kv_blocks_used: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    num_preemptions: int  # since start
    num_prompt_tokens_computed: int  # since start: prompt positions this engine computed
    busy_seconds: float  # since start: time spent in steps that computed something
    running_by_priority: dict[int, int]
    waiting_by_priority: dict[int, int]
    ranks_alive: int = 1  # of the engine's parallel group; fewer than ranks_total: unhealthy
    ranks_total: int = 1
    devices: tuple[str, ...] = ("cpu",)  # rank r's device


class LLMEngine:
    def __init__(
        self, config: EngineConfig, model: LlamaForCausalLM, num_kv_blocks: int,
        enable_chunked_prefill: bool = True, waiting: WaitingQueue | None = None,
        kv_pool: torch.Tensor | None = None, group: RankGroup | None = None,
    ) -> None:
        """`kv_pool`: the pool KV transports see, a tensor of `self.kv_layout.shape` (shared
        memory for host_shm), else one is allocated when first used. `group`: ranks 1..N-1 of a
        multi-rank engine (this process is rank 0 and `model` holds its shards); closed by
        `close`.

        The pool transports see always has the whole model's layout (every layer, every KV
        head), so engines with different TP/PP layouts can hand KV to each other. A single-rank
        engine computes in it directly; a multi-rank one computes in per-rank slices and copies
        a handed-off sequence's blocks into it (gathered from the ranks) when its prefill ends,
        and out of it (scattered to the ranks) when a handoff arrives."""
        self.config = config
        self.kv_layout = kv_layout(config, num_kv_blocks, whole=True)
        if kv_pool is not None and kv_pool.shape != self.kv_layout.shape:
            raise ValueError(f"KV pool shape {tuple(kv_pool.shape)} != {self.kv_layout.shape}")
        self._handoff_pool = kv_pool
        self.device = model.ctx.device
        self.devices = group.devices if group is not None else [self.device]  # rank r's
        work_pool = kv_pool if group is None else None
        if work_pool is None:
            work_pool = allocate_pool(kv_layout(config, num_kv_blocks), device=self.device)
        self.blocks = BlockManager(num_kv_blocks, config.limits.block_size)
        self.scheduler = Scheduler(config.limits, self.blocks, enable_chunked_prefill, waiting)
        self.runner = ModelRunner(model, work_pool, config.limits.block_size, group)
        self._handoffs: deque[_Handoff] = deque()
        self.busy_seconds = 0.0
        # Called after a step's handoffs were pulled (a KV sink sends their releases).
        self.after_handoffs: Callable[[], None] = lambda: None

    @classmethod
    def from_engine_dir(
        cls, engine_dir: str | Path, num_kv_blocks: int, enable_chunked_prefill: bool = True,
        waiting: WaitingQueue | None = None,
        kv_pool: Callable[[KVLayout, torch.device], torch.Tensor] | None = None,
        placement: Placement | None = None,
    ) -> LLMEngine:
        """`kv_pool`: makes the pool for the engine's layout on rank 0's device (default: plain
        memory there). `placement`: where the instance's ranks compute (default: the CPU)."""
        config = EngineConfig.load(engine_dir)
        devices = (placement or Placement()).devices(config.parallel.world_size)
        group = None
        if config.parallel.world_size > 1:
            group = RankGroup(engine_dir, config, num_kv_blocks, devices)
        try:
            ctx = group.ctx if group else ParallelContext(config.parallel, device=devices[0])
            model = load_model(engine_dir, config, ctx)
            if group is not None:
                group.wait_ready()
            whole = kv_layout(config, num_kv_blocks, whole=True)
            pool = kv_pool(whole, devices[0]) if kv_pool is not None else None
            return cls(config, model, num_kv_blocks, enable_chunked_prefill, waiting, pool, group)
        except BaseException:
            if group is not None:
                group.close()
            raise

    def close(self) -> None:
        """Stop the engine's other ranks, if any (idempotent)."""
        if self.runner.group is not None:
            self.runner.group.close()

    @property
    def kv_pool(self) -> torch.Tensor:
        """The pool KV transports read from and write into (see __init__)."""
        if self.runner.group is None:
            return self.runner.kv_pool
        if self._handoff_pool is None:
            self._handoff_pool = allocate_pool(self.kv_layout, device=self.device)
        return self._handoff_pool

    def add_request(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
        priority: int = 0, tenant: str = "default", prefill_only: bool = False,
    ) -> Sequence:
        """Queue a sequence. `prefill_only`: stop after the first token and keep the blocks
        (see Sequence.prefill_only); the caller releases them with `blocks.release`."""
        seq = Sequence(seq_id, list(prompt_ids), params, priority=priority, tenant=tenant,
                       prefill_only=prefill_only)
        self.scheduler.add(seq)
        return seq

    def add_handoff(
        self, seq_id: str, prompt_ids: list[int], first_token: int, first_logprob: float,
        params: SamplingParams, num_kv_tokens: int, fetch: KVFetch,
        priority: int = 0, tenant: str = "default",
    ) -> Sequence:
        """Continue a sequence another instance prefilled: it has its first token, and the KV of
        its first `num_kv_tokens` tokens is elsewhere. Before the next step, blocks are
        allocated and `fetch` fills them; if it cannot, the prompt is recomputed here."""
        seq = Sequence(seq_id, list(prompt_ids), params, priority=priority, tenant=tenant)
        seq.output_ids.append(first_token)
        seq.first_token_time = time.monotonic()  # decode time counts from the handoff
        if params.return_log_probs:
            seq.output_logprobs.append(first_logprob)
        if num_kv_tokens > seq.num_prompt_tokens:
            raise ValueError(f"{num_kv_tokens} KV tokens for a {seq.num_prompt_tokens}-token "
                             "prompt")
        self.scheduler.check_fits(seq)
        self._handoffs.append(_Handoff(seq, num_kv_tokens, fetch))
        return seq

    def _admit_handoffs(self) -> None:
        """Pull handed-off KV while blocks are free (in arrival order), then queue the
        sequences like any other: computed up to the handed-off tokens, or not at all."""
        admitted = False
        while self._handoffs:
            h = self._handoffs[0]
            need = self.blocks.blocks_for(h.num_kv_tokens)
            if not self.blocks.can_allocate(need) and self.scheduler.has_unfinished:
                break  # blocks free up as running sequences finish
            self._handoffs.popleft()
            admitted = True
            blocks = self.blocks.allocate(need) if self.blocks.can_allocate(need) else None
            if blocks is not None and h.fetch(blocks):
                if self.runner.group is not None:  # scatter the whole-model KV to the ranks
                    self.runner.group.import_kv(self.runner.kv_pool, self.kv_pool, blocks)
                h.seq.block_table = blocks
                h.seq.num_computed_tokens = h.num_kv_tokens
            elif blocks is not None:
                self.blocks.release(blocks)
            self.scheduler.add(h.seq)
        if admitted:
            self.after_handoffs()

    def abort(self, seq_id: str) -> Sequence | None:
        for h in self._handoffs:
            if h.seq.seq_id == seq_id:
                self._handoffs.remove(h)
                h.seq.status = SequenceStatus.FINISHED
                h.seq.finish_reason = FinishReason.CANCELLED
                return h.seq
        return self.scheduler.abort(seq_id)

    def sequences(self) -> list[Sequence]:
        """Every unfinished sequence: running, waiting or handed off and not yet admitted."""
        return [*self.scheduler.running, *self.scheduler.waiting,
                *(h.seq for h in self._handoffs)]

    @property
    def has_unfinished(self) -> bool:
        return bool(self._handoffs) or self.scheduler.has_unfinished

    def step(self) -> list[TokenEvent]:
        """schedule -> run -> sample -> update; returns one event per sampled sequence."""
        start = time.perf_counter()
        self._admit_handoffs()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        try:
            return self._run(out)
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _run(self, out: SchedulerOutput) -> list[TokenEvent]:
        logits, sampling = self.runner.run(out)
        result = sample(sampling, logits) if sampling else SampleResult([], None)
        seqs = self.scheduler.update(out, result)
        events = [self._event(s) for s in seqs]
        if self.runner.group is not None:
            handed = [b for e in events if e.kv_blocks for b in e.kv_blocks]
            if handed:  # gather their KV from the ranks into the pool transports read
                self.runner.group.export_kv(self.runner.kv_pool, self.kv_pool, handed)
        return events

    @staticmethod
    def _event(s: Sequence) -> TokenEvent:
        handed_over = s.prefill_only and s.is_finished and s.finish_reason is None
        prefill_time = decode_time = None
        if s.num_output_tokens == 1 and s.first_token_time and s.queue_time is not None:
            prefill_time = s.first_token_time - s.arrival_time - s.queue_time
        if s.finish_reason is not None and s.first_token_time is not None:
            decode_time = time.monotonic() - s.first_token_time
        event = TokenEvent(
            seq_id=s.seq_id,
            token_id=s.output_ids[-1],
            logprob=s.output_logprobs[-1] if s.params.return_log_probs else None,
            finish_reason=s.finish_reason,
            num_prompt_tokens=s.num_prompt_tokens,
            num_output_tokens=s.num_output_tokens,
            queue_time=s.queue_time if s.num_output_tokens == 1 else None,
            prefill_time=prefill_time,
            decode_time=decode_time,
            kv_blocks=tuple(s.block_table) if handed_over else None,
            kv_tokens=s.num_computed_tokens if handed_over else 0,
        )
        if handed_over:
            s.block_table = []
        return event

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._handoffs),
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            busy_seconds=self.busy_seconds,
            running_by_priority=dict(Counter(s.priority for s in self.scheduler.running)),
            waiting_by_priority=dict(Counter(s.priority for s in self.scheduler.waiting)),
            ranks_alive=self.runner.group.ranks_alive if self.runner.group else 1,
            ranks_total=self.config.parallel.world_size,
            devices=tuple(str(d) for d in self.devices),
        )



def kv_layout(config: EngineConfig, num_kv_blocks: int, rank: int = 0,
              whole: bool = False) -> KVLayout:
    """The KV pool of rank `rank`: its stage's layers and its tensor-parallel share of heads;
    `whole`: every layer and head (what KV transports move, whatever the layout)."""
    ctx = ParallelContext() if whole else ParallelContext(config.parallel, rank)
    m = config.model
    return KVLayout(
        num_layers=len(ctx.layout.stage_layers(m.num_layers, ctx.pp_rank)),
        num_kv_heads=m.num_kv_heads // ctx.tp_size, head_dim=m.head_dim,
        block_size=config.limits.block_size, dtype=config.dtype, num_blocks=num_kv_blocks,
        tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
