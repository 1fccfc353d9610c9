"""The autoscaler on the live server: load pushes TTFT p95 over the threshold and it adds a
prefill instance; load removed, it scales back down after the cooldown; requests in flight
during both resizes complete with the right output."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from python_backends.ops.autoscaler import Autoscaler, Controller, Policy
from tests.e2e.conftest import MAX_TOKENS, PROMPTS, Reference, Server

pytestmark = pytest.mark.e2e
GREEDY = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "route": "disaggregated"}


class Load:
    """Threads sending disaggregated requests and checking each against the HF reference."""

    def __init__(self, server: Server, reference: Reference, threads: int, pause_s: float):
        self.server, self.reference, self.pause_s = server, reference, pause_s
        self.stop = threading.Event()
        self.done = 0
        self.wrong: list[Any] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        n = i
        while not self.stop.is_set():
            prompt = PROMPTS[n % len(PROMPTS)]
            n += 1
            try:
                out = self.server.client.stream_collect(prompt, **GREEDY).output_ids
            except Exception as e:  # any failure during a resize is a defect
                self.wrong.append((prompt, repr(e)))
                continue
            if out != self.reference.outputs[prompt]:
                self.wrong.append((prompt, out))
            self.done += 1
            time.sleep(self.pause_s)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def _tick_until(controller: Controller, want: str, timeout_s: float) -> list[Any]:
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen += [(d.group, d.direction, d.reason) for d in controller.tick()]
        if any(f"{g}:{d}" == want for g, d, _ in seen):
            return seen
        time.sleep(1.0)
    raise AssertionError(f"no {want} decision in {timeout_s} s; saw {seen}")


def test_autoscaler_resizes_prefill_with_requests_in_flight(
    server: Server, reference: Reference
) -> None:
    repo = server.options.repository()
    assert repo.instance_count("prefill") == 1
    policy = Policy(ttft_p95_s=0.05, window_s=6, scale_up_cooldown_s=3,
                    scale_down_cooldown_s=8, idle_fraction=0.3,
                    bounds={"prefill": (1, 2), "worker": (1, 1), "decode": (1, 1)})
    controller = Controller(Autoscaler(policy), repo, server.options.metrics_url)
    controller.refresh_counts()
    assert controller.counts == {"worker": 1, "prefill": 1, "decode": 1}
    try:
        busy = Load(server, reference, threads=3, pause_s=0.0)
        try:
            seen = _tick_until(controller, "prefill:up", timeout_s=90)
        finally:
            busy.finish()
        assert any("TTFT p95" in reason for g, d, reason in seen if g == "prefill")
        assert repo.instance_count("prefill") == 2
        instances = {dict(k)["instance"]
                     for k in server.metrics()["llm_kv_cache_blocks_used"]
                     if ("model", "prefill") in k}
        assert len(instances) == 2
        # The load goes: a light one remains, whose TTFT (a few hundred ms on this CPU) is
        # within a realistic threshold, and the mostly idle prefill group shrinks back while
        # its requests are in flight.
        controller.scaler.policy = dataclasses.replace(policy, ttft_p95_s=5.0)
        light = Load(server, reference, threads=1, pause_s=1.0)
        try:
            _tick_until(controller, "prefill:down", timeout_s=120)
            time.sleep(2.0)  # requests keep flowing on the reloaded model
        finally:
            light.finish()
        assert repo.instance_count("prefill") == 1
        assert controller.decisions[("prefill", "up")] >= 1
        assert controller.decisions[("prefill", "down")] == 1
        assert busy.done > 0 and light.done > 0
        assert busy.wrong == [] and light.wrong == []
        text = controller.exposition()
        assert 'llm_autoscaler_decisions_total{group="prefill",direction="up"}' in text
        assert server.wait_idle(timeout=60) == 0  # the removed instance's gauges read 0 too
    finally:
        if repo.instance_count("prefill") != 1:
            repo.set_instance_count("prefill", 1)


def test_reload_keeps_http_streams_whole(server: Server) -> None:
    """Server-sent-event streams in flight while the repository API reloads a model get every
    token. (Through Triton 2.51's HTTP load API they lost the tokens produced during the load
    and still ended cleanly; the repository client loads over gRPC, see its docstring.)"""
    from concurrent.futures import ThreadPoolExecutor

    n_tokens = 160
    repo = server.options.repository()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(server.client.stream_collect, PROMPTS[i % len(PROMPTS)],
                               max_tokens=n_tokens, end_id=-1, route="aggregated")
                   for i in range(6)]
        time.sleep(3.0)  # every stream is producing tokens
        with repo.reloaded("decode", restart_revision="99"):
            pass  # loaded with the changed parameter, then with the original config again
        results = [f.result(timeout=120) for f in futures]  # a lost final event hangs
    for r in results:
        assert len(r.output_ids) == n_tokens and r.finish_reason == "length"
