"""scripts/bench_engine.py end to end on a tiny engine: every level served, its bounds and the
verdicts on a peer's figures written out."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import TinyModel, load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_engine")


def test_levels_parse(bench: ModuleType) -> None:
    assert bench.parse_levels("1=43,8=160.5,") == {1: 43.0, 8: 160.5}
    assert bench.parse_levels("") == {}


def test_a_run_prints_and_writes_every_level(bench: ModuleType, tiny_llama: TinyModel,
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = bench.main(["--engine", str(tiny_llama.engine_dir), "--concurrency", "1,4",
                     "--requests", "6", "--prompt-tokens", "10", "--output-tokens", "3",
                     "--threads", "1", "--peer", "1=1e9,4=0.001", "--peer-itl-ms", "1e6",
                     "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [level["concurrency"] for level in result["levels"]] == [1, 4]
    first, second = result["levels"]
    assert first["engine_tok_s"] > 0 and first["bound_1_cores_tok_s"] > 0
    # a peer a billion tokens/s fast cannot be doubled; one at 0.001 can
    assert first["twice_peer_within_bound"] is False
    assert second["twice_peer_within_bound"] is True
    printed = capsys.readouterr().out
    assert "concurrency 4: engine alone" in printed
    assert "half the peer's time between tokens at concurrency 1 is 500000.0 ms: within" in printed
