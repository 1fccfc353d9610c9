"""One engine instance: a model, its KV pool and its batch scheduler."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from python_backends.config import EngineConfig
from python_backends.engine.block_manager import BlockManager
from python_backends.engine.loader import load_model
from python_backends.engine.model_runner import ModelRunner
from python_backends.engine.sampler import SampleResult, sample
from python_backends.engine.scheduler import Scheduler
from python_backends.engine.sequence import FinishReason, SamplingParams, Sequence
from python_backends.engine.waiting_queue import WaitingQueue
from python_backends.models.llama import LlamaForCausalLM


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


@dataclass(frozen=True)
class EngineStats:
    kv_blocks_used: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    num_preemptions: int  # since start
    running_by_priority: dict[int, int]
    waiting_by_priority: dict[int, int]


class LLMEngine:
    def __init__(
        self, config: EngineConfig, model: LlamaForCausalLM, num_kv_blocks: int,
        enable_chunked_prefill: bool = True, waiting: WaitingQueue | None = None,
    ) -> None:
        self.config = config
        self.blocks = BlockManager(num_kv_blocks, config.limits.block_size)
        self.scheduler = Scheduler(config.limits, self.blocks, enable_chunked_prefill, waiting)
        self.runner = ModelRunner(model, num_kv_blocks, config.limits.block_size)

    @classmethod
    def from_engine_dir(
        cls, engine_dir: str | Path, num_kv_blocks: int, enable_chunked_prefill: bool = True,
        waiting: WaitingQueue | None = None,
    ) -> LLMEngine:
        config = EngineConfig.load(engine_dir)
        model = load_model(engine_dir, config)
        return cls(config, model, num_kv_blocks, enable_chunked_prefill, waiting)

    def add_request(
        self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
        priority: int = 0, tenant: str = "default",
    ) -> Sequence:
        seq = Sequence(seq_id, list(prompt_ids), params, priority=priority, tenant=tenant)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq_id: str) -> Sequence | None:
        return self.scheduler.abort(seq_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[TokenEvent]:
        """schedule -> run -> sample -> update; returns one event per sampled sequence."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        logits, sampling = self.runner.run(out)
        result = sample(sampling, logits) if sampling else SampleResult([], None)
        seqs = self.scheduler.update(out, result)
        return [
            TokenEvent(
                seq_id=s.seq_id,
                token_id=s.output_ids[-1],
                logprob=s.output_logprobs[-1] if s.params.return_log_probs else None,
                finish_reason=s.finish_reason,
                num_prompt_tokens=s.num_prompt_tokens,
                num_output_tokens=s.num_output_tokens,
                queue_time=s.queue_time if s.num_output_tokens == 1 else None,
            )
            for s in seqs
        ]

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            running_by_priority=dict(Counter(s.priority for s in self.scheduler.running)),
            waiting_by_priority=dict(Counter(s.priority for s in self.scheduler.waiting)),
        )

