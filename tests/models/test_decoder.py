"""The decoder's load-time choices (models/decoder.py): which form steps of more rows than a
tile read their projections' weights in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from python_backends.models import decoder, kernels
from python_backends.parallel.layers import Linear
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.skipif(not kernels.load(), reason="no native kernels here")


@pytest.fixture
def unpack_rows() -> Iterator[None]:
    """The process-wide setting, put back after the test."""
    before = torch.ops.llm_kernels.set_unpack_rows(0)
    yield
    torch.ops.llm_kernels.set_unpack_rows(before)


def scripted(monkeypatch: pytest.MonkeyPatch, panels: list[float],
             unpacked: list[float]) -> list[int]:
    """pass_seconds answering from the lists by the kernel's setting; returns the settings seen."""
    seen: list[int] = []
    times = {False: iter(panels), True: iter(unpacked)}

    def timed(_linears: list[Linear], rows: int, repeats: int) -> float:
        assert rows == decoder.UNPACK_TIMING_ROWS and repeats == 1
        setting = torch.ops.llm_kernels.set_unpack_rows(0)
        torch.ops.llm_kernels.set_unpack_rows(setting)
        seen.append(setting)
        return next(times[setting > 0])

    monkeypatch.setattr(decoder, "pass_seconds", timed)
    return seen


@pytest.mark.parametrize(("panels", "unpacked", "wins"), [
    ([1.0] * 3, [0.9] * 3, True),
    ([1.0] * 3, [0.97] * 3, False),  # within the margin: not worth it
    ([1.0] * 3, [1.2] * 3, False),
])
def test_the_narrower_forms_are_unpacked_only_where_clearly_faster(
        monkeypatch: pytest.MonkeyPatch, unpack_rows: None, panels: list[float],
        unpacked: list[float], wins: bool) -> None:
    torch.ops.llm_kernels.set_unpack_rows(5)
    scripted(monkeypatch, panels, unpacked)
    assert decoder.unpacked_reads_faster([]) == (wins, unpacked[0], panels[0])
    assert torch.ops.llm_kernels.set_unpack_rows(0) == 5  # the caller's setting put back


def test_the_two_ways_are_timed_in_turn_and_each_keeps_its_best(
        monkeypatch: pytest.MonkeyPatch, unpack_rows: None) -> None:
    """A burst of another process's work during one way's first timing must not decide."""
    seen = scripted(monkeypatch, [1.0, 1.0, 1.0], [3.0, 0.8, 0.8])
    assert decoder.unpacked_reads_faster([]) == (True, 0.8, 1.0)
    assert [s > 0 for s in seen] == [False, True] * 3


@pytest.mark.parametrize("wins", [True, False])
def test_an_engine_sets_what_it_measured(monkeypatch: pytest.MonkeyPatch, unpack_rows: None,
                                         tmp_path: Path, wins: bool) -> None:
    def bfloat16_values(hf: torch.nn.Module) -> None:  # so that every projection has a form
        with torch.no_grad():
            for m in hf.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(m.weight.bfloat16().float())

    measured: list[list[Linear]] = []

    def measure(linears: list[Linear]) -> tuple[bool, float, float]:
        measured.append(linears)
        return wins, 1.0, 1.0

    monkeypatch.setattr(decoder, "unpacked_reads_faster", measure)
    tiny = make_tiny_llama(tmp_path / "engine", weights=bfloat16_values)
    threads = torch.get_num_threads()
    try:
        engine = tiny.engine(cpu_threads=1)  # one thread: the native kernels
    finally:
        torch.set_num_threads(threads)
    [linears] = measured
    every = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears == every and all(m.native_blocks is not None for m in every)
    assert (torch.ops.llm_kernels.set_unpack_rows(0) > 0) is wins
    engine.close()
