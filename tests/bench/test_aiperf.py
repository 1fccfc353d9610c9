"""aiperf's command line (python_backends/bench/aiperf.py); runs against a server: tests/e2e."""

from pathlib import Path

import pytest

from python_backends.bench.aiperf import PACE_HZ, Target, command

TARGET = Target.openai("http://127.0.0.1:1", "m")


def _command(**pace: float) -> list[str]:
    return command("aiperf", TARGET, concurrency=32, requests=64, prompt_tokens=128,
                   output_tokens=64, tokenizer=Path("/engine"), artifacts=Path("/out"), **pace)


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_paced_by_default() -> None:
    cmd = _command()
    assert PACE_HZ > 0
    assert float(_flag(cmd, "--request-rate") or 0) == PACE_HZ
    assert _flag(cmd, "--request-rate-mode") == "constant"
    assert _flag(cmd, "--concurrency") == "32"
    assert _flag(cmd, "--request-count") == "64"


def test_zero_pace_is_aiperfs_plain_concurrency_mode() -> None:
    cmd = _command(pace_hz=0)
    assert "--request-rate" not in cmd and "--request-rate-mode" not in cmd
    assert _flag(cmd, "--concurrency") == "32"


def test_negative_pace_refused() -> None:
    with pytest.raises(ValueError, match="pace_hz"):
        _command(pace_hz=-1)
