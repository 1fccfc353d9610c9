"""scripts/bench_sweep.py's options that need no server (the sweeps themselves run against real
servers: docs/benchmarks.md)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    return load_script("bench_sweep")


@pytest.mark.parametrize("argv,want", [
    ([], (32, 32)),  # the highest level, as many requests as its concurrency
    (["--warmup-requests", "5"], (32, 5)),
    (["--warmup-requests", "0"], (32, 0)),  # none
    (["--warmup-requests", "-3"], (32, 0)),
])
def test_warm_up_runs_the_highest_level(sweep: ModuleType, argv: list[str],
                                        want: tuple[int, int]) -> None:
    args = sweep._parser().parse_args(["--concurrency", "8,32,1", *argv])
    assert sweep._warmup(args, [8, 32, 1]) == want
