"""The short soak CI runs: scripts/soak.py as a user runs it, on a server of its own, for 90 s
under its fault schedule (worker, decode, prefill and front stubs killed; NIXL failures
injected). Nothing may hang, no greedy answer may differ from Hugging Face's, no valid request
may get a server error, and no KV block may stay held."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ENGINE_DIR
from tests.upstream import UPSTREAM_ABORT

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _triton_aborted(error: BaseException) -> bool:
    """Triton 2.51's own abort when a killed stub held a shared-memory lock (docs/platform.md):
    the soak runs once more; any other failure, or the abort twice, fails."""
    return UPSTREAM_ABORT in str(error)


@pytest.mark.flaky(reruns=1, condition=_triton_aborted)
def test_short_soak_under_faults(tmp_path: Path) -> None:
    report_file = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--duration", "90",
         "--request-timeout", "30", "--faults", "worker,decode,prefill,front",
         "--engine-dir", str(ENGINE_DIR), "--json", str(report_file)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    print(proc.stdout[-8000:])
    assert report_file.is_file(), proc.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert not report["server_died"], report["server_exit"]
    outcomes = report["outcomes"]
    assert outcomes["hung"] == outcomes["mismatched"] == 0, report["examples"]
    assert outcomes["server_error"] == outcomes["unexpected"] == 0, report["examples"]
    assert report["kv_blocks_held_at_end"] == 0
    assert outcomes["completed"] > 50 and outcomes["refused"] > 0
    assert report["migrations"] > 0  # the engine kills moved requests
    assert [f["fault"] for f in report["faults"]] == ["worker", "decode", "prefill", "front"]
    assert proc.returncode == 0 and report["ok"]
