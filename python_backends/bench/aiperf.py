"""Driving aiperf (NVIDIA's LLM benchmark client) against this server or an OpenAI-compatible peer.

aiperf lives in its own environment (its dependencies want numpy 2; the Triton stub's must stay
below 2): `scripts/test.sh` creates `.venv-aiperf`, or by hand
`python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0 matplotlib`.
Our server is driven through its `generate_stream` endpoint with aiperf's template endpoint
(see docs/platform.md), the end id ignored so every request produces exactly `output_tokens`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from python_backends.config import PROJECT_ROOT

TEMPLATE = ('{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, '
            '"stream": {{ stream|tojson }}, "end_id": -1, "exclude_input_in_output": true}')


# aiperf 0.13 with --concurrency alone ("burst" timing) polls for a free slot in a loop that only
# yields to its event loop: its timing_manager process took 0.8 of this 2-core machine's cores for
# the whole of a concurrency-32 run, CPU the server under test then lacks. Adding a constant
# request rate makes it sleep between looks: at 100/s a freed slot is refilled within 10 ms (a
# request here takes 1-15 s), 32 slots fill in 0.32 s, and the looks cost a few % of a core.
PACE_HZ = 100.0


class AiperfError(RuntimeError):
    pass


def find_aiperf(explicit: str | None = None) -> str | None:
    """The aiperf executable: `explicit`, $AIPERF, .venv-aiperf, then $PATH."""
    default = str(PROJECT_ROOT / ".venv-aiperf" / "bin" / "aiperf")
    for candidate in (explicit, os.environ.get("AIPERF"), default, shutil.which("aiperf")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@dataclass(frozen=True)
class Target:
    """What aiperf drives: a name for the tables, a base URL, a model and endpoint arguments."""

    name: str
    url: str
    model: str
    endpoint_args: tuple[str, ...]

    @property
    def endpoint(self) -> str:
        """What aiperf sends requests to, for the result rows: the custom path, else the
        endpoint type (completions, chat)."""
        flags = dict(zip(self.endpoint_args[::2], self.endpoint_args[1::2], strict=False))
        return flags.get("--custom-endpoint") or flags.get("--endpoint-type", "")

    @classmethod
    def ours(cls, url: str, workdir: Path, name: str = "triton-llm") -> Target:
        template = workdir / "aiperf-template.json"
        template.write_text(TEMPLATE)
        return cls(name, url, "ensemble", (
            "--endpoint-type", "template",
            "--custom-endpoint", "/v2/models/ensemble/generate_stream",
            "--extra-inputs", f"payload_template:{template}",
            "--extra-inputs", "response_field:text_output"))

    @classmethod
    def openai(cls, url: str, model: str, endpoint: str = "completions", name: str = "peer",
               ignore_eos: bool = True, greedy: bool = False) -> Target:
        """`ignore_eos`: send vLLM's `ignore_eos` (a server that refuses unknown fields must
        then be configured without an end token to produce every output token). `greedy`:
        temperature 0, so two servers of the same weights generate the same tokens."""
        extra: tuple[str, ...] = ("--extra-inputs", "ignore_eos:true") if ignore_eos else ()
        if greedy:
            extra += ("--extra-inputs", "temperature:0")
        return cls(name, url, model, ("--endpoint-type", endpoint, *extra))


def command(aiperf: str, target: Target, *, concurrency: int, requests: int, prompt_tokens: int,
            output_tokens: int, tokenizer: Path, artifacts: Path,
            pace_hz: float = PACE_HZ, prompts: Path | None = None) -> list[str]:
    """aiperf's command line for one run (see `profile`)."""
    if pace_hz < 0:
        raise ValueError(f"pace_hz must be >= 0, got {pace_hz}")
    pacing = ("--request-rate", f"{pace_hz:g}", "--request-rate-mode", "constant")
    workload = (("--input-file", str(prompts), "--custom-dataset-type", "single_turn")
                if prompts is not None else ("--isl", str(prompt_tokens)))
    return [aiperf, "profile", "--url", target.url, "-m", target.model,
            "--streaming", "--ui", "none", "--no-server-metrics",
            *workload, "--osl", str(output_tokens),
            "--concurrency", str(concurrency), "--request-count", str(requests),
            *(pacing if pace_hz > 0 else ()),
            "--tokenizer", str(tokenizer), "--artifact-dir", str(artifacts), "--random-seed", "1",
            *target.endpoint_args]


def profile(aiperf: str, target: Target, *, concurrency: int, requests: int, prompt_tokens: int,
            output_tokens: int, tokenizer: Path, artifacts: Path, pace_hz: float = PACE_HZ,
            timeout_s: float = 1800.0, prompts: Path | None = None) -> dict[str, Any]:
    """One aiperf run (streaming, fixed prompt/output lengths, no warm-up, so the server's own
    histograms see exactly these requests); returns aiperf's summary (profile_export_aiperf.json:
    per metric a dict of avg/p50/p95/...; latencies in ms). `prompts`: aiperf's single_turn
    JSONL ({"text": ...} a line) instead of random prompts of `prompt_tokens`; `output_tokens`
    is then each request's limit (the end token is the target's to honour: `Target.openai`).

    `pace_hz` > 0: aiperf looks for a free concurrency slot that many times a second (a constant
    `--request-rate` capped by `--concurrency`); 0: aiperf's plain concurrency mode, whose timing
    process polls for a free slot without sleeping (see PACE_HZ)."""
    cmd = command(aiperf, target, concurrency=concurrency, requests=requests,
                  prompt_tokens=prompt_tokens, output_tokens=output_tokens, tokenizer=tokenizer,
                  artifacts=artifacts, pace_hz=pace_hz, prompts=prompts)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise AiperfError(f"aiperf did not finish in {timeout_s:.0f} s") from e
    summary = artifacts / "profile_export_aiperf.json"
    if done.returncode != 0 or not summary.is_file():
        raise AiperfError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                          f"{done.stderr[-3000:]}")
    return dict(json.loads(summary.read_text()))
