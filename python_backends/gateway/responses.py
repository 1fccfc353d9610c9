"""OpenAI's response shapes for completions and chat completions, streamed and whole."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from python_backends.gateway.protocol import Generation

# token id -> its text, for logprobs
TokenText = Callable[[int], str]


@dataclass
class Answer:
    """What the client has been sent so far of one choice, and the counts for `usage`."""

    gen: Generation
    token_text: TokenText
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    @property
    def object(self) -> str:
        return "chat.completion" if self.gen.chat else "text_completion"

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def chunk(self, text: str, token_ids: list[int], logprobs: list[float],
              finish_reason: str | None, first: bool) -> dict[str, Any]:
        """One streamed event (made before `text` is added to the answer)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason,
                                  "logprobs": self._logprobs(token_ids, logprobs, len(self.text))}
        if self.gen.chat:
            choice["delta"] = ({"role": "assistant", "content": text} if first
                               else {"content": text} if text or not finish_reason else {})
        else:
            choice["text"] = text
        out = self._head(f"{self.object}.chunk" if self.gen.chat else self.object)
        out["choices"] = [choice]
        if self.gen.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict[str, Any]:
        """stream_options.include_usage: the last event, with no choices."""
        out = self._head(f"{self.object}.chunk" if self.gen.chat else self.object)
        out["choices"] = []
        out["usage"] = self.usage()
        return out

    def whole(self) -> dict[str, Any]:
        """The non-streaming response."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason,
                                  "logprobs": self._logprobs(self.token_ids, self.logprobs, 0)}
        if self.gen.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        out = self._head(self.object)
        out["choices"] = [choice]
        out["usage"] = self.usage()
        return out

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.gen.model}

    def _logprobs(self, token_ids: list[int], logprobs: list[float], start: int) -> Any:
        """`start`: where these tokens' text begins in the choice's text (completions)."""
        if not self.gen.logprobs or not token_ids:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        if self.gen.chat:
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                 "top_logprobs": []} for tok, lp in zip(tokens, logprobs,
                                                                         strict=False)]}
        offsets, at = [], start
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens, "token_logprobs": logprobs[:len(tokens)],
                "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, logprobs, strict=False)],
                "text_offset": offsets}
