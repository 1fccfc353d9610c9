"""Errors as OpenAI's clients expect them: a status that says what to do, and the JSON body
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any

from python_backends.front.admission import OVERLOADED_PREFIX, RATE_LIMITED_PREFIX

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}


class ApiError(Exception):
    """A request ends with this status and message; `param` names the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 server_ok: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        # the server lost the request but serves again (its front restarted): a move may go
        # back to it
        self.server_ok = server_ok

    @property
    def retryable(self) -> bool:
        """Another server may serve the request (this one is down, overloaded or has no
        engine left); a refusal of the request itself or of its tenant is final."""
        return self.status == 503

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"invalid request field '{param}': {message}", param)


def from_triton(message: str) -> ApiError:
    """The status of a Triton server's error, read from its message: through the 2.51 ensemble
    a gRPC stream's error carries no status (docs/gateway.md). Refusals of the request name
    its field ('invalid input ...', 'bad request'); the front's refusals begin with their
    reason (front.admission); an engine or server that failed is worth another server."""
    text = message.strip()
    if text.startswith(RATE_LIMITED_PREFIX):
        return ApiError(429, text)
    if "invalid input" in text or "bad request" in text or "unknown input" in text:
        return ApiError(400, text)
    if text.startswith(OVERLOADED_PREFIX) or _unavailable(text):
        return ApiError(503, text)
    return ApiError(500, text or "the server failed the request without a message")


def _unavailable(text: str) -> bool:
    return any(s in text for s in (
        "no engine instance is left", "not healthy", "is not ready", "unavailable",
        "UNAVAILABLE", "shutting down", "Failed to connect", "Connection refused",
        "failed to connect", "Socket closed", "Deadline Exceeded", "DEADLINE_EXCEEDED"))
