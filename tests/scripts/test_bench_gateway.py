"""scripts/bench_gateway.py's paired figures: what the gateway added to each pair of twins."""

from __future__ import annotations

import argparse
import os
from types import ModuleType

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_gateway")


def test_pairs_give_the_added_ttft_arrival_and_pace(bench: ModuleType) -> None:
    direct = (10.0, [10.100, 10.200, 10.300])
    # sent 1 ms later, first token 3 ms later, its tokens 4, 1 and 5 ms later, pace +0.5 ms
    gateway = (10.001, [10.104, 10.201, 10.305])
    d = bench.pair_deltas([(direct, gateway)])
    assert d["pairs"] == d["matched"] == 1
    assert d["ttft_p50_ms"] == pytest.approx(3.0)
    assert (d["ttft_direct_p50_ms"], d["ttft_gateway_p50_ms"]) == pytest.approx((100.0, 103.0))
    assert d["arrival_p50_ms"] == pytest.approx(4.0)  # the median of 4, 1 and 5 ms
    assert d["itl_p50_ms"] == pytest.approx(0.5)


def test_streams_of_different_lengths_give_ttft_only(bench: ModuleType) -> None:
    d = bench.pair_deltas([((0.0, [0.1, 0.2]), (0.0, [0.102]))])
    assert (d["pairs"], d["matched"]) == (1, 0)
    assert d["ttft_p50_ms"] == pytest.approx(2.0)
    assert d["arrival_p50_ms"] != d["arrival_p50_ms"]  # NaN: nothing to compare


def test_cpu_split_leaves_the_server_a_cpu(bench: ModuleType) -> None:
    every = os.sched_getaffinity(0)
    p = argparse.ArgumentParser()
    assert bench.split_cpus(p, "") == (every, every)
    with pytest.raises(SystemExit):
        bench.split_cpus(p, ",".join(str(c) for c in every))
    with pytest.raises(SystemExit):
        bench.split_cpus(p, "x")
