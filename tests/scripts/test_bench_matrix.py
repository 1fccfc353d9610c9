"""scripts/bench_matrix.py without servers: judging results already measured, its dry run and
its options (the sweeps themselves run against real servers: docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from python_backends.models import cpu_isa
from tests.bench.test_matrix import PEER, rows_of
from tests.conftest import load_script


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script("bench_matrix")


def test_judge_prints_and_writes_the_verdict_and_the_cells_not_measured(
        script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps(rows_of("aiperf", "chat", "amx",
                                          {1: (300.0, 900.0, 20.0), 32: (150.0, 400.0, 40.0)},
                                          PEER)))
    out = tmp_path / "out"
    rc = script.main(["--judge", str(results), "--best-path", "amx", "--paths", "amx",
                      "--clients", "aiperf,vllm", "--datasets", "chat", "--out-dir", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "MISS aiperf           chat      amx         c32  tok/s      1.50x" in printed
    assert "NOT MEASURED: vllm chat amx" in printed
    assert "3 of 4 targets met" in printed  # tok/s at 1 and 32, TTFT p95 at 32, ITL p50 at 1
    saved = json.loads((out / "matrix.json").read_text())
    assert [c["ok"] for c in saved["checks"]] == [True, False, True, True]
    assert saved["not_measured"] == ["vllm chat amx"]
    assert "| amx | aiperf | chat | 32 | tok/s | 1.50x | >= 2x | **no** |" in (
        out / "matrix.md").read_text()


def test_dry_run_lists_one_capped_sweep_per_cell(script: ModuleType, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    have = cpu_isa.available()
    if not have:
        pytest.skip("this CPU has no engine path")
    assert script.main(["--dry-run", "--paths", have[0], "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.count(f"{cpu_isa.CAP_ENV}={have[0]} ") == 4  # 2 clients x 2 datasets
    assert f"--out-dir {tmp_path}/{have[0]}/vllm-synthetic" in printed
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


@pytest.mark.parametrize("argv,message", [
    (["--clients", "genai-perf"], "--clients: one or more of aiperf, vllm"),
    (["--datasets", ""], "--datasets"),
    (["--paths", "sse4"], "--paths"),
    (["--judge", "/nonexistent/results.json"], "--judge: cannot read /nonexistent/results.json"),
])
def test_bad_options_are_named(script: ModuleType, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        script.main(["--dry-run", *argv])
