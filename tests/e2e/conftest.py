"""One real Triton server per test session, on free ports, serving the default engine, and
Hugging Face transformers' greedy output as the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from python_backends.bench.client import GenerateError, LLMClient
from python_backends.config import DEFAULT_ENGINE_DIR
from python_backends.diagnostics import request_stack_dumps
from python_backends.metrics_text import metric_sum, parse_metrics, scrape
from python_backends.ops.launcher import (
    ServerError,
    ServerOptions,
    TritonServer,
    free_port,
    launch_gateway,
    stop_process,
)
from python_backends.procfs import Stub, live_stubs
from tests.upstream import UPSTREAM_ABORT

ENGINE_DIR = Path(os.environ.get("LLM_ENGINE_DIR", DEFAULT_ENGINE_DIR))

# French, Chinese, emoji, code and plain English: multi-byte characters must survive streaming.
PROMPTS = [
    "The capital of France is",
    "La recette de la crêpe bretonne commence par",
    "中国的首都是",
    "My favourite emojis are 🍕, 🎉 and",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 24


# Stub instances that tests kill on purpose (test_watchdog.py); any other restart is reported.
KILLED_BY_TESTS: set[str] = set()


@dataclass
class Server:
    options: ServerOptions
    client: LLMClient
    log_file: Path
    triton: TritonServer

    def metrics(self) -> dict[str, Any]:
        return scrape(self.options.metrics_url)

    def kv_blocks_used(self) -> float:
        return metric_sum(self.metrics(), "llm_kv_cache_blocks_used")

    def wait_metric(self, name: str, want: float, timeout: float = 10.0, **labels: str) -> float:
        """`wait_metric` on this server."""
        return wait_metric([self.options.metrics_url], name, want, timeout, **labels)

    def stacks_and_log(self, log_lines: int = 60) -> str:
        """Every stub's and engine rank's thread stacks (see python_backends.diagnostics), then
        the server log's last lines: what a failed test reports, so a hang in CI can be read."""
        assert self.triton.process is not None
        start = self.log_file.stat().st_size
        request_stack_dumps(self.triton.process.pid)
        time.sleep(0.5)
        with self.log_file.open("rb") as f:
            before = f.read(start).decode(errors="replace").splitlines()
            stacks = f.read().decode(errors="replace")
        return "\n".join([*compact_stacks(stacks), "--- server log, last lines ---",
                          *before[-log_lines:]])

    def wait_idle(self, timeout: float = 20.0) -> float:
        """Wait until no KV block is in use; returns the last reading."""
        return wait_no_kv_blocks([self.options.metrics_url], timeout)


def poll_metric(metrics_urls: list[str], name: str, done: Callable[[float], bool],
                timeout: float, interval: float, **labels: str) -> float:
    """Scrape the metric, summed over the servers behind `metrics_urls` (like `metric_sum`),
    every `interval` s until `done` holds for it or `timeout` s have passed; the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        got = sum(metric_sum(scrape(url), name, **labels) for url in metrics_urls)
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(interval)


def wait_metric(metrics_urls: list[str], name: str, want: float, timeout: float = 10.0,
                **labels: str) -> float:
    """Wait until the metric reads at least `want` (poll_metric). Engines publish their gauges
    after a step, at most every PUBLISH_INTERVAL_S, so a scrape right after a token may still
    read the value from before it."""
    return poll_metric(metrics_urls, name, lambda got: got >= want, timeout, 0.02, **labels)


def steady_metric(metrics_urls: list[str], name: str, timeout: float = 10.0,
                  **labels: str) -> float:
    """The metric once two readings 0.6 s apart agree (poll_metric): engines publish after a
    step at most every PUBLISH_INTERVAL_S and every 0.5 s when idle, so a counter read right
    after earlier requests may not hold their last step yet."""
    last: list[float] = []

    def agrees(got: float) -> bool:
        same = bool(last) and last[-1] == got
        last.append(got)
        return same

    return poll_metric(metrics_urls, name, agrees, timeout, 0.6, **labels)


def wait_no_kv_blocks(metrics_urls: list[str], timeout: float = 20.0) -> float:
    """Wait until the servers behind `metrics_urls` hold no KV block; returns the last count."""
    return poll_metric(metrics_urls, "llm_kv_cache_blocks_used", lambda used: not used, timeout,
                       0.2)


def compact_stacks(dump: str, keep: int = 4) -> list[str]:
    """faulthandler's thread dumps with each thread cut to its `keep` innermost frames plus
    every frame in this project: idle library threads otherwise fill the report."""
    out: list[str] = []
    frames = 0
    for line in dump.splitlines():
        if not line.startswith("  File "):
            out.append(line)
            frames = 0
            continue
        frames += 1
        if frames <= keep or "python_backends" in line:
            out.append(line)
    return out


_SESSION_SERVER: list[Server] = []  # the running server, for the failure report


def triton_aborted(error: BaseException | None = None) -> bool:
    """Whether the session server died of Triton 2.51's own abort when a stub is killed
    holding a shared-memory lock (docs/platform.md): the rerun condition of the tests that kill
    stubs (`@pytest.mark.flaky(reruns=1, condition=triton_aborted)`). Any other failure, and
    the same abort twice, fail the test."""
    if not _SESSION_SERVER:
        return False
    reason = _SESSION_SERVER[0].triton.exit_reason()
    aborted = reason is not None and UPSTREAM_ABORT in reason
    if aborted:
        print(f"\n[e2e] tritonserver aborted ({reason}); the test runs again on a fresh "
              "server", file=sys.__stderr__, flush=True)
    return aborted


# Tests that kill stubs on purpose: rerun once when that made Triton itself abort.
KILLS_STUBS = pytest.mark.flaky(reruns=1, condition=triton_aborted)


@pytest.fixture(autouse=True)
def _session_server_alive(request: pytest.FixtureRequest) -> None:
    """A session server that died (Triton's abort above) is started again before the next
    test, so one abort fails at most the test it happened in."""
    if "server" not in request.fixturenames or not _SESSION_SERVER:
        return
    triton = _SESSION_SERVER[0].triton
    reason = triton.exit_reason()
    if reason is not None:
        print(f"\n[e2e] the session server died ({reason}); starting it again",
              file=sys.__stderr__, flush=True)
        triton.restart()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed and report.when == "call" and _SESSION_SERVER:
        try:
            report.sections.append(("stub stacks and server log",
                                    _SESSION_SERVER[0].stacks_and_log()))
        except Exception as e:  # the report must not hide the failure
            report.sections.append(("stub stacks and server log", f"unavailable: {e}"))
    return report


def newest_stub(server: Server, model: str) -> Stub:
    """The stub of `model` started last: the serving one, when an old version's stub lingers
    (an ensemble request Triton 2.51 never ends keeps the old version loaded: see
    docs/operations.md, "When an engine dies")."""
    assert server.triton.process is not None
    stubs = [s for s in live_stubs(server.triton.process.pid) if s.model == model]
    assert stubs, f"no {model} stub"
    return max(stubs, key=lambda s: s.started)


def only_stub(server: Server, model: str, timeout: float = 30) -> Stub:
    """The one stub of `model` (waiting for a previous version's to stop)."""
    assert server.triton.process is not None
    deadline = time.monotonic() + timeout
    while len(stubs := [s for s in live_stubs(server.triton.process.pid)
                        if s.model == model]) != 1:
        assert time.monotonic() < deadline, stubs
        time.sleep(0.1)
    return stubs[0]


def wait_restarted(server: Server, model: str, dead_pid: int, timeout: float = 120) -> None:
    """The watchdog brought `model` back: a new stub, and a request on its path is served."""
    assert server.triton.process is not None
    route = "aggregated" if model == "worker" else "disaggregated"
    deadline = time.monotonic() + timeout
    while True:
        stubs = [s for s in live_stubs(server.triton.process.pid) if s.model == model]
        if stubs and dead_pid not in {s.pid for s in stubs}:
            try:
                server.client.generate(PROMPTS[0], max_tokens=2, route=route)
                return
            except GenerateError:
                pass
        assert time.monotonic() < deadline, f"{model} was not restarted"
        time.sleep(0.5)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not (ENGINE_DIR / "config.json").is_file():
        pytest.fail(f"no engine at {ENGINE_DIR}: run scripts/test.sh (it builds the engine)")
    log_file = tmp_path_factory.mktemp("triton") / "server.log"
    opts = ServerOptions(
        http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        engine_dir=ENGINE_DIR, log_file=log_file, fault_injection=True,
        exit_timeout_s=5,  # idle keep-alive connections hold shutdown for the whole timeout
    )
    triton = TritonServer(opts)
    triton.start()
    try:
        triton.wait_ready(timeout_s=600)
    except Exception:
        triton.stop()
        print(log_file.read_text()[-5000:])
        raise
    # A request that hangs fails its test in minutes, not in the client's default ten.
    _SESSION_SERVER.append(Server(opts, LLMClient(opts.http_url, timeout=180), log_file, triton))
    try:
        yield _SESSION_SERVER[0]
    finally:
        _SESSION_SERVER.clear()
        restarts = triton.watchdog.restarts if triton.watchdog else []
        triton.stop()
        unplanned = [r for r in restarts if r[0] not in KILLED_BY_TESTS]
        if unplanned:  # a stub died by itself: say so past pytest's capture, with the log
            lines = [line for line in log_file.read_text(errors="replace").splitlines()
                     if any(k in line for k in ("watchdog", "Stub process", "ignal", "corrupt"))]
            print(f"\n[e2e] the stub watchdog restarted {unplanned}; server log lines:",
                  *lines[-40:], sep="\n", file=sys.__stderr__, flush=True)


@dataclass
class Reference:
    tokenizer: Any
    outputs: dict[str, list[int]]

    def text(self, prompt: str) -> str:
        """HF's decoding of the reference ids; a character cut off by max_tokens (decoded as
        U+FFFD) is never sent by the server, so it is not expected either."""
        text = self.tokenizer.decode(self.outputs[prompt], skip_special_tokens=True)
        return str(text).rstrip("\ufffd")


def hf_greedy(prompts: list[str], max_tokens: int) -> Reference:
    """Hugging Face greedy generate on the GGUF itself (not on our engine's weights)."""
    from transformers import AutoTokenizer

    from python_backends.engine import builder

    return Reference(AutoTokenizer.from_pretrained(str(ENGINE_DIR)),
                     builder.hf_greedy(ENGINE_DIR, prompts, max_tokens))


@pytest.fixture(scope="session")
def reference() -> Reference:
    return hf_greedy(PROMPTS, MAX_TOKENS)


# --- the gateway (python_backends/gateway) in front of test servers ---

GATEWAY_KEY = "sk-test"


class Gateway:
    """A gateway process started by `start_gateway`."""

    def __init__(self, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = proc
        self.log = log

    def openai(self, key: str = GATEWAY_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0,
                             timeout=120)

    def metrics(self) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
        return parse_metrics(requests.get(f"{self.url}/metrics", timeout=10).text)


def start_gateway(tmp: Path, config: dict[str, Any], healthy: bool = True) -> Gateway:
    """`python -m python_backends.gateway` with this configuration, on a free port, once it
    answers /health (200; or 503 when `healthy` is False)."""
    path = tmp / "gateway.json"
    path.write_text(json.dumps(config))
    port = free_port()
    log = tmp / "gateway.log"
    try:
        proc = launch_gateway(["--config", str(path)], "127.0.0.1", port, log=log,
                              ready=(200,) if healthy else (200, 503))
    except ServerError as e:
        raise AssertionError(f"the gateway did not start ({e}): {log.read_text()[-3000:]}") \
            from None
    return Gateway(port, proc, log)


def stop_gateway(gw: Gateway) -> None:
    stop_process(gw.proc)


@pytest.fixture(scope="session")
def gateway(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A plain gateway (no keys, no limits) in front of the session's server alone; modules
    that need another configuration define their own `gateway`."""
    o = server.options
    gw = start_gateway(tmp_path_factory.mktemp("gateway"), {
        "engine_dir": str(ENGINE_DIR),
        "backends": [{"name": "local", "grpc": f"127.0.0.1:{o.grpc_port}",
                      "metrics": o.metrics_url}],
    })
    yield gw
    stop_gateway(gw)
