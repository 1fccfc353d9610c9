"""A small client for the `ensemble` over Triton's HTTP generate endpoints and metrics port.

Used by the end-to-end tests and the benchmark; any Triton client works the same way.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import requests

from python_backends.wire import FINISH_ERROR


class GenerateError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass
class StreamResult:
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    start: float = field(default_factory=time.monotonic)
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


class LLMClient:
    def __init__(self, base_url: str, model: str = "ensemble", timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self._local = threading.local()

    @property
    def session(self) -> requests.Session:
        """One connection pool per thread: a shared Session is not thread-safe."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _url(self, endpoint: str) -> str:
        return f"{self.base_url}/v2/models/{self.model}/{endpoint}"

    def generate(self, text: str | None, **inputs: Any) -> dict[str, Any]:
        """One non-streaming request; raises GenerateError with Triton's message on failure."""
        body = dict(inputs) if text is None else {"text_input": text, **inputs}
        r = self.session.post(self._url("generate"), data=json.dumps(body), timeout=self.timeout)
        payload = r.json()
        if r.status_code != 200 or "error" in payload:
            raise GenerateError(r.status_code, payload.get("error", r.text))
        return dict(payload)

    def stream(self, text: str, **inputs: Any) -> Generator[dict[str, Any], None, None]:
        """Server-sent events of a streaming request, one dict per response."""
        body = {"text_input": text, "stream": True, **inputs}
        with self.session.post(self._url("generate_stream"), data=json.dumps(body),
                               stream=True, timeout=self.timeout) as r:
            if r.status_code != 200:
                raise GenerateError(r.status_code, r.text)
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:  # Triton's error event: a failure before the first chunk
                    raise GenerateError(400, event["error"])
                if event.get("finish_reason") == FINISH_ERROR:  # a failure after it
                    raise GenerateError(r.status_code, event.get("error_message", ""))
                yield event

    def stream_collect(self, text: str, **inputs: Any) -> StreamResult:
        result = StreamResult()
        for event in self.stream(text, **inputs):
            now = time.monotonic()
            ids = as_list(event.get("output_ids", []))
            result.token_times.extend([now] * len(ids))
            result.output_ids.extend(ids)
            result.text += event.get("text_output", "")
            result.finish_reason = event.get("finish_reason", "")
            result.num_input_tokens = event.get("num_input_tokens", 0)
            result.num_output_tokens = event.get("num_output_tokens", 0)
        return result


def as_list(value: Any) -> list[Any]:
    """Triton's JSON writes a one-element tensor as a bare value."""
    return value if isinstance(value, list) else [value]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linearly interpolated; NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
