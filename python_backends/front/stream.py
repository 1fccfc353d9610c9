"""Per-request output state in the front: turns engine token events into client chunks.

Each chunk (wire.ClientChunk) carries what stateless postprocessing needs: a window of token
ids whose first `prefix_len` are context (see python_backends.detokenizer), plus counts,
log-probs and the cancel flag postprocessing raises when the client goes away.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from python_backends.detokenizer import STREAM_CONTEXT_TOKENS
from python_backends.wire import ClientChunk


@dataclass
class RequestStream:
    prompt_ids: list[int]
    stream: bool
    exclude_input_in_output: bool
    return_log_probs: bool
    cancel_board: str = ""  # the front's board and this request's ticket on it
    cancel_ticket: int = 0
    top_log_probs: int = 0  # alternatives per token (k): top_ids and top_lps hold k per token
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_lps: list[float] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str = ""

    def resume(self, token_ids: list[int]) -> None:
        """Tokens generated before, on a server that failed: they count as output (toward
        max_tokens, and as context of the next chunk's text) but are never sent again. Their
        log-probabilities are not known here (0; their alternatives' ids -1)."""
        self.output_ids.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.top_ids.extend([-1] * len(token_ids) * self.top_log_probs)
        self.top_lps.extend([0.0] * len(token_ids) * self.top_log_probs)

    def add(
        self, token_ids: list[int], logprobs: list[float], finish_reason: str,
        top_ids: list[int] | None = None, top_lps: list[float] | None = None,
    ) -> ClientChunk | None:
        """Record one engine response (`top_ids`, `top_lps`: its tokens' alternatives, k per
        token); returns the chunk to send now, if any."""
        now = time.monotonic()
        if token_ids and self.first_token_time is None:
            self.first_token_time = now
        if token_ids:
            self.last_token_time = now
        start = len(self.output_ids)
        self.output_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        k = self.top_log_probs
        if k:  # an engine that gave none (a token drawn elsewhere): unknown alternatives
            missing = len(token_ids) * k - len(top_ids or [])
            self.top_ids.extend([*(top_ids or []), *[-1] * missing])
            self.top_lps.extend([*(top_lps or []), *[0.0] * missing])
        self.finish_reason = finish_reason
        if self.stream:
            if not token_ids and not finish_reason:
                return None
            lo = max(0, start - STREAM_CONTEXT_TOKENS)
            return self._chunk(self.output_ids[lo:], start - lo, start)
        if not finish_reason:
            return None
        return self.final_chunk()

    def final_chunk(self) -> ClientChunk:
        """The whole answer in one chunk (non-streaming requests)."""
        tokens = self.output_ids if self.exclude_input_in_output else (
            self.prompt_ids + self.output_ids
        )
        return self._chunk(list(tokens), 0, 0)

    def _chunk(self, tokens: list[int], prefix_len: int, start: int) -> ClientChunk:
        """The chunk reporting the output tokens from `start` on."""
        k = self.top_log_probs
        return ClientChunk(
            cancel_board=self.cancel_board,
            cancel_ticket=self.cancel_ticket,
            tokens=tokens,
            prefix_len=prefix_len,
            output_ids=self.output_ids[start:],
            finish_reason=self.finish_reason,
            num_input_tokens=len(self.prompt_ids),
            num_output_tokens=len(self.output_ids),
            cum_log_prob=float(sum(self.logprobs)),
            output_log_probs=self.logprobs[start:] if self.return_log_probs else [],
            error="",
            top_ids=self.top_ids[start * k:],
            top_log_probs=self.top_lps[start * k:],
        )

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        n = len(self.output_ids)
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)
