"""Stack dumps on demand (python_backends.diagnostics) through the running server: what a
failed end-to-end test reports, and what an operator gets from `kill -USR1 <stub pid>`."""

from __future__ import annotations

import pytest

from python_backends.bench.client import as_list
from python_backends.procfs import live_stubs
from tests.e2e.conftest import MAX_TOKENS, PROMPTS, Reference, Server

pytestmark = pytest.mark.e2e
ENGINE_MODELS = {"worker", "prefill", "decode"}


def test_every_stub_dumps_its_stacks_and_keeps_serving(
    server: Server, reference: Reference
) -> None:
    assert server.triton.process is not None
    stubs = live_stubs(server.triton.process.pid)
    report = server.stacks_and_log()
    stacks = report.split("--- server log, last lines ---")[0]
    # Every process lists at least its main thread; every engine instance its engine loop.
    assert stacks.count("(most recent call first):") >= len(stubs), report
    loops = [line for line in stacks.splitlines() if "engine_loop.py" in line and "in _run" in line]
    assert len(loops) >= sum(s.model in ENGINE_MODELS for s in stubs) >= 3, report
    # The signal is handled, not fatal: the same stubs serve the next request correctly.
    out = server.client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, exclude_input_in_output=True)
    assert as_list(out["output_ids"]) == reference.outputs[PROMPTS[0]]
    assert live_stubs(server.triton.process.pid) == stubs
