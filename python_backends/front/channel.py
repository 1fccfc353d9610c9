"""One interface for "send this request to that engine group": the front's orchestration
(front.orchestrator) calls engine groups through it and never learns where a group lives.

Two implementations: an in-server group called over BLS (serving.front.LocalGroup, Triton
glue) and a group on other servers called over gRPC streaming (front.remote.RemoteGroup).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from python_backends.front.migration import Moved
from python_backends.wire import EngineRequest, ErrorKind, Message, PrefillReply


@dataclass(frozen=True)
class Reply:
    """One reply of an engine call, local or remote, not yet decoded: its tensors, or an
    error. `unavailable`: the engine's server or instance is gone, so the request may go on
    elsewhere."""

    outputs: dict[str, np.ndarray] | None = None
    error: str = ""
    kind: str = ErrorKind.INTERNAL.value  # the error's ErrorKind value
    unavailable: bool = False


class EngineLost(Exception):
    """The engine holding a call died, or its instance or server is not there to take it: the
    request may go on elsewhere (front.migration)."""

    def __init__(self, moved: Moved) -> None:
        super().__init__(moved.detail)
        self.moved = moved


class Caller(Protocol):
    """What a channel needs of the request it carries."""

    @property
    def ticket(self) -> int:
        """The request's ticket on the front's cancel board."""
        ...

    def check_cancelled(self) -> bool:
        """Whether the client went away (asked again on every wait)."""
        ...


class Channel(Protocol):
    """An engine group: one model, served in this server or by others."""

    model: str
    # Whether a call after a lost one avoids what was lost: a remote group leaves the server
    # out for a while; Triton may hand a local call to the same dead instance again.
    steers_away: bool

    def replies(self, message: EngineRequest, reply_type: type[Message],
                caller: Caller) -> Iterator[Reply]:
        """The replies of one call of `message`, each decoding as `reply_type` or carrying an
        error, until the call ends. Raises EngineLost when the engine holding the call is
        gone; a client that goes away ends the call on the engine too."""
        ...

    def live(self) -> bool:
        """Whether some instance of the group can take a call now."""
        ...


def batched(reply_type: type[Message]) -> bool:
    """Whether calls replied to with `reply_type` carry a batch dimension: prefill takes dynamic
    batches, engines that stream do not."""
    return reply_type is PrefillReply
