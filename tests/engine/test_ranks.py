"""How many torch threads each rank of an engine gets."""

from __future__ import annotations

import pytest

from python_backends.engine import ranks
from python_backends.engine.ranks import threads_per_rank


@pytest.mark.parametrize(("cores", "world", "setting", "want"), [
    (2, 1, 0, 1),    # every core but one: the other is Triton's, the stubs' and the clients'
    (16, 1, 0, 15),
    (16, 2, 0, 7),   # split over the ranks
    (2, 2, 0, 1),    # never fewer than one
    (1, 1, 0, 1),
    (16, 1, 4, 4),   # set by the model's cpu_threads parameter
    (16, 2, 4, 2),
    (2, 4, 2, 1),
])
def test_threads_per_rank(monkeypatch: pytest.MonkeyPatch, cores: int, world: int, setting: int,
                          want: int) -> None:
    monkeypatch.setattr(ranks.os, "cpu_count", lambda: cores)
    assert threads_per_rank(world, setting) == want
