"""What a request asks of the engine (validated by python_backends.front.validation) and why a
sequence ended. Free of torch, so the front model need not load it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    STOP = "stop"  # end id or a stop sequence
    LENGTH = "length"  # max_tokens or the engine's max_seq_len
    CANCELLED = "cancelled"  # the client went away
    ERROR = "error"  # the engine failed the sequence (the front answers with the error)


@dataclass(frozen=True)
class SamplingParams:
    """Validated per-request generation settings (see python_backends.front.validation)."""

    max_tokens: int
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0  # tokens below min_p x the likeliest token's probability are dropped
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    end_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    bad_sequences: tuple[tuple[int, ...], ...] = ()
    return_log_probs: bool = False
    top_log_probs: int = 0  # with each token, the log-probabilities of this many likeliest
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output (python_backends.guides): the output is constrained to this guide's
    # language; "" for none.
    guide_type: str = ""
    guide: str = ""

    @property
    def guided(self) -> bool:
        return bool(self.guide_type)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_logits_processing(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 0
            or bool(self.bad_sequences)
            or bool(self.logit_bias)
        )
