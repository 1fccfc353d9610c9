"""Request migration: a request whose engine instance died goes on elsewhere.

The front notices the death in one of three ways (`MigrationReason`): the engine process that
took the request is gone (front.liveness.HolderWatch, checked whenever the engine has been quiet
for a moment); the engine answered that it cannot go on (an UNAVAILABLE error: a rank of its
parallel group died, or it is shutting down); or Triton refused the call because the instance's
stub is dead and not yet restarted ("Stub process '...' is not healthy", answered at once).

It then sends the request again, with the tokens generated so far as `resume_ids`
(wire.EngineRequest), to an engine model with a live instance (`next_engine`): the same model
or the other path's engine (decode when the workers are gone, the workers when decode is). The
new engine computes prompt and resumed tokens (mostly from the prefix cache or the KV store)
and goes on; the client's stream continues with no gap and no duplicate, and greedy output
equals an undisturbed run. A request moves at most `limit` times, and when no engine is left it
ends with a clear error at once.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

# How Triton 2.51 answers a call routed to an instance whose stub died.
STUB_UNHEALTHY = "is not healthy"


class MigrationReason(enum.Enum):
    ENGINE_DIED = "engine_died"  # the process holding the request is gone
    ENGINE_UNAVAILABLE = "engine_unavailable"  # the engine said it cannot go on
    INSTANCE_DOWN = "instance_down"  # Triton refused the call: the instance's stub is dead


@dataclass(frozen=True)
class Moved:
    """A call to an engine ended without finishing its request, which may go on elsewhere."""

    reason: MigrationReason
    detail: str


def next_engine(model: str, others: list[str], reason: MigrationReason,
                live: Callable[[str], bool]) -> str | None:
    """The engine model to continue on, None when every engine is gone. After a death, `model`
    first while it has a live instance (another replica, or the one the watchdog restarted);
    after a refusal or an engine that cannot go on, `others` first, since Triton would likely
    pick the same broken instance again."""
    order = [model, *others] if reason is MigrationReason.ENGINE_DIED else [*others, model]
    for candidate in order:
        if candidate and live(candidate):
            return candidate
    return None


@dataclass
class MigrationBudget:
    """At most `limit` moves per request."""

    limit: int
    moves: int = 0

    def spend(self) -> bool:
        """Take one move; False when the request has none left."""
        if self.moves >= self.limit:
            return False
        self.moves += 1
        return True
