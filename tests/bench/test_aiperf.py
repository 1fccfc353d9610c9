"""aiperf's command line (python_backends/bench/aiperf.py); runs against a server: tests/e2e."""

from pathlib import Path

import pytest

from python_backends.bench.aiperf import PACE_HZ, Target, command

TARGET = Target.openai("http://127.0.0.1:1", "m")


def _command(pace_hz: float = PACE_HZ, prompts: Path | None = None) -> list[str]:
    return command("aiperf", TARGET, concurrency=32, requests=64, prompt_tokens=128,
                   output_tokens=64, tokenizer=Path("/engine"), artifacts=Path("/out"),
                   pace_hz=pace_hz, prompts=prompts)


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


def test_a_prompt_file_replaces_the_random_prompts() -> None:
    cmd = _command(prompts=Path("/chat.jsonl"))
    assert _flag(cmd, "--input-file") == "/chat.jsonl"
    assert _flag(cmd, "--custom-dataset-type") == "single_turn"
    assert "--isl" not in cmd and _flag(cmd, "--osl") == "64"
    assert _flag(_command(), "--isl") == "128" and "--input-file" not in _command()


def test_a_greedy_chat_target_asks_for_temperature_zero_and_keeps_the_end_token() -> None:
    args = Target.openai("http://h", "m", "chat", ignore_eos=False, greedy=True).endpoint_args
    assert args == ("--endpoint-type", "chat", "--extra-inputs", "temperature:0")


def test_a_target_names_its_endpoint_for_the_rows(tmp_path: Path) -> None:
    assert TARGET.endpoint == "completions"
    assert Target.openai("http://h", "m", "chat", ignore_eos=False).endpoint == "chat"
    assert Target.ours("http://h", tmp_path).endpoint == "/v2/models/ensemble/generate_stream"
