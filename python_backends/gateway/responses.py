"""OpenAI's response shapes for completions and chat completions, streamed and whole, with one
or more choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from python_backends.gateway.protocol import Generation
from python_backends.gateway.tools import ToolCalls

# token id -> its text, for logprobs
TokenText = Callable[[int], str]


@dataclass
class Choice:
    """What the client has been sent so far of one choice, and its counts for `usage`."""

    index: int
    prompt_index: int  # which of the request's prompts it continues
    text: str = ""  # content (chat: outside tool calls)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # with top_logprobs
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    tools: ToolCalls | None = None  # chat with tools: the calls read from the output

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.logprobs)


@dataclass
class Answer:
    """One request's answer: its choices, in the order OpenAI indexes them (by prompt, then
    by choice)."""

    gen: Generation
    token_text: TokenText
    choices: list[Choice] = field(default_factory=list)
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.gen.chat else "text_completion"

    def usage(self) -> dict[str, int]:
        """Each prompt counted once, however many choices continue it."""
        prompts = {c.prompt_index: c.prompt_tokens for c in self.choices}
        prompt_tokens = sum(prompts.values())
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def chunk(self, choice: Choice, text: str, token_ids: list[int], logprobs: list[float],
              top: list[list[tuple[int, float]]], finish_reason: str | None, first: bool,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One streamed event of `choice` (made before `text` is added to it)."""
        out: dict[str, Any] = {"index": choice.index, "finish_reason": finish_reason,
                               "logprobs": self._logprobs(token_ids, logprobs, top,
                                                          len(choice.text))}
        if self.gen.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or (first and not tool_calls) or not (finish_reason or tool_calls):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            out["delta"] = delta
        else:
            out["text"] = text
        event = self._head(f"{self.object}.chunk" if self.gen.chat else self.object)
        event["choices"] = [out]
        if self.gen.include_usage:
            event["usage"] = None
        return event

    def usage_chunk(self) -> dict[str, Any]:
        """stream_options.include_usage: the last event, with no choices."""
        out = self._head(f"{self.object}.chunk" if self.gen.chat else self.object)
        out["choices"] = []
        out["usage"] = self.usage()
        return out

    def whole(self, choices: list[Choice] | None = None) -> dict[str, Any]:
        """The non-streaming response: `choices` (default all), renumbered in order; usage
        counts every choice generated."""
        shown = []
        for index, c in enumerate(self.choices if choices is None else choices):
            out: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason,
                                   "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top,
                                                              0)}
            if self.gen.chat:
                calls = c.tools.calls if c.tools else []
                out["message"] = {"role": "assistant",
                                  "content": (c.text.strip() or None) if calls else c.text}
                if calls:
                    out["message"]["tool_calls"] = [{k: v for k, v in call.items()
                                                     if k != "index"} for call in calls]
            else:
                out["text"] = c.text
            shown.append(out)
        event = self._head(self.object)
        event["choices"] = shown
        event["usage"] = self.usage()
        return event

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.gen.model}

    def _logprobs(self, token_ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]], start: int) -> Any:
        """`start`: where these tokens' text begins in the choice's text (completions). `top`:
        each token's alternatives (with top_logprobs, else none)."""
        if not self.gen.logprobs or not token_ids:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        alternatives = top or [[] for _ in tokens]
        if self.gen.chat:
            return {"content": [
                {**self._entry(tok, lp), "top_logprobs": [
                    self._entry(self.token_text(t), alt) for t, alt in alts]}
                for tok, lp, alts in zip(tokens, logprobs, alternatives, strict=False)]}
        offsets, at = [], start
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        # vLLM's form: each token's alternatives, and the token itself
        tops = [{**{self.token_text(t): alt for t, alt in alts}, tok: lp}
                for tok, lp, alts in zip(tokens, logprobs, alternatives, strict=False)]
        return {"tokens": tokens, "token_logprobs": logprobs[:len(tokens)],
                "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
