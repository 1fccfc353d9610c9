"""Three Triton servers behind one gateway, as two regions (eu: the session's server; us: two
of this module's own, role `aggregated`, the whole pipeline with the worker engine alone): a
tenant pinned to eu is never served in us; a us server as a canary gets its share of users; and
when a us server dies, stops answering, or restarts its front with streams in flight, every
stream goes on on another server (the prompt and the tokens so far) with output identical to
Hugging Face's, while new traffic from us goes to the us server left."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from python_backends.front.validation import FAULT_PARAMETERS
from python_backends.metrics_text import metric_sum
from python_backends.ops.launcher import ServerOptions, TritonServer, free_port
from python_backends.procfs import live_stubs
from tests.e2e.conftest import (
    ENGINE_DIR,
    Gateway,
    Reference,
    Server,
    hf_greedy,
    start_gateway,
    stop_gateway,
    wait_no_kv_blocks,
)
from tests.e2e.test_gateway import MODEL

pytestmark = pytest.mark.e2e
KEY, PINNED_KEY = "sk-any", "sk-eu-bank"
US = {"x-region": "us"}  # the client's region (latency-aware routing)
STREAMS = [f"Story {i}: once upon a time, in a village by the sea," for i in range(8)]
LONG = 48
USERS = 1000


@pytest.fixture(scope="module")
def us_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TritonServer]]:
    """us-1 and us-2, started together."""
    servers = [TritonServer(ServerOptions(
        http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        engine_dir=ENGINE_DIR, log_file=tmp_path_factory.mktemp(f"us-{i}") / "server.log",
        exit_timeout_s=5, role="aggregated")) for i in (1, 2)]
    try:
        for triton in servers:
            triton.start()
        for triton in servers:
            triton.wait_ready(timeout_s=600)
        yield servers
    finally:
        for triton in servers:
            triton.stop()


def _backends(server: Server, us_servers: list[TritonServer],
              canary: str = "") -> list[dict[str, Any]]:
    named = [("eu-1", "eu", server.options)] + [
        (f"us-{i}", "us", t.options) for i, t in enumerate(us_servers, 1)]
    return [{"name": name, "grpc": o.grpc_address, "metrics": o.metrics_url, "region": region,
             "canary": name == canary} for name, region, o in named]


@pytest.fixture(scope="module")
def gateway(server: Server, us_servers: list[TritonServer],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_gateway(tmp_path_factory.mktemp("gateway3"), {
        "model": MODEL, "engine_dir": str(ENGINE_DIR), "health_interval_s": 0.5,
        "backends": _backends(server, us_servers),
        "api_keys": {KEY: "anyone", PINNED_KEY: "eu-bank"},
        # a client's own region first, while its servers answer within 30 s
        "routing": {"residency": {"eu-bank": ["eu"]}, "latency_bound_s": 30},
    })
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="module")
def long_reference() -> Reference:
    return hf_greedy(STREAMS, LONG)


def test_a_server_started_as_operators_do_refuses_injected_faults(
        us_servers: list[TritonServer]) -> None:
    # the us servers are started without fault injection (the session's server has it on)
    for name, values in FAULT_PARAMETERS.items():
        value = values[0]
        r = requests.post(f"{us_servers[0].options.http_url}/v2/models/ensemble/generate",
                          json={"text_input": "Hi", "max_tokens": 2, name: value}, timeout=60)
        assert r.status_code == 400, r.text
        assert f"'{name}'" in r.json()["error"] and "fault injection is off" in r.json()["error"]


def test_a_canary_gets_its_share_of_users(server: Server, us_servers: list[TritonServer],
                                          tmp_path: Path) -> None:
    """us-2 as a 10% canary: 1000 users, one request each, through a gateway of its own."""
    gw = start_gateway(tmp_path, {
        "model": MODEL, "engine_dir": str(ENGINE_DIR),
        "backends": _backends(server, us_servers, canary="us-2"),
        "routing": {"canary_fraction": 0.1}})
    try:
        def one(i: int) -> int:
            r = requests.post(f"{gw.url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 1, "user": f"user-{i}"})
            return r.status_code

        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(one, range(USERS)))
        assert statuses == [200] * USERS
        on_canary = _served(gw, "us-2")
        assert on_canary + _served(gw, "eu-1") + _served(gw, "us-1") == USERS
        print(f"canary share: {on_canary / USERS:.1%} of {USERS} users")
        assert 0.07 * USERS <= on_canary <= 0.13 * USERS
    finally:
        stop_gateway(gw)


def _served(gw: Gateway, backend: str) -> float:
    return metric_sum(gw.metrics(), "gateway_requests_total", backend=backend, status="200")


def _finished(metrics_url: str) -> float:
    from python_backends.metrics_text import scrape

    return metric_sum(scrape(metrics_url), "llm_requests_finished_total")


def _finished_at_least(metrics_urls: list[str], total: float, timeout: float = 10.0) -> float:
    """The servers' finished-request count once it reaches `total` (or at `timeout`): the front
    counts a request after sending its last answer, so a client can be back first."""
    deadline = time.monotonic() + timeout
    while True:
        count = sum(_finished(url) for url in metrics_urls)
        if count >= total or time.monotonic() > deadline:
            return count
        time.sleep(0.1)


def test_a_pinned_tenant_is_never_served_outside_its_region(
    gateway: Gateway, server: Server, us_servers: list[TritonServer],
) -> None:
    us_urls = [t.options.metrics_url for t in us_servers]
    us_before = [_finished(url) for url in us_urls]
    eu_before = _finished(server.options.metrics_url)
    pinned = gateway.openai(PINNED_KEY).with_options(default_headers=US)  # a client in us
    for i in range(6):
        pinned.completions.create(model=MODEL, prompt=f"Fact {i}:", max_tokens=2)
    eu_url = server.options.metrics_url
    assert _finished_at_least([eu_url], eu_before + 6) == eu_before + 6
    assert [_finished(url) for url in us_urls] == us_before  # never in us
    # other tenants in us are served there, by both us servers
    anyone = gateway.openai(KEY).with_options(default_headers=US)
    threads = [threading.Thread(target=lambda i=i: anyone.completions.create(
        model=MODEL, prompt=f"Tale {i}:", max_tokens=8)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert _finished_at_least(us_urls, sum(us_before) + 6) == sum(us_before) + 6
    us_after = [_finished(url) for url in us_urls]
    assert all(a > b for a, b in zip(us_after, us_before, strict=True)), (us_before, us_after)
    assert _finished(eu_url) == eu_before + 6


class Streams:
    """8 greedy streams from a us client through the gateway, each on its own thread."""

    def __init__(self, gateway: Gateway) -> None:
        client = gateway.openai(KEY).with_options(default_headers=US)
        self.texts = ["" for _ in STREAMS]
        self.errors: list[BaseException] = []
        started = [threading.Event() for _ in STREAMS]

        def run(i: int) -> None:
            try:
                for event in client.completions.create(model=MODEL, prompt=STREAMS[i],
                                                       max_tokens=LONG, temperature=0,
                                                       stream=True):
                    self.texts[i] += event.choices[0].text if event.choices else ""
                    started[i].set()
            except BaseException as e:  # reported by `finish`
                self.errors.append(e)
                started[i].set()

        self.threads = [threading.Thread(target=run, args=(i,)) for i in range(len(STREAMS))]
        for t in self.threads:
            t.start()
        assert all(e.wait(120) for e in started)

    def finish(self, reference: Reference) -> None:
        """Every stream ended, with Hugging Face's greedy text."""
        for t in self.threads:
            t.join(180)
        assert not any(t.is_alive() for t in self.threads), "a stream is still open"
        assert not self.errors, self.errors
        for i, prompt in enumerate(STREAMS):
            assert self.texts[i] == reference.text(prompt), i


def _in_flight(gateway: Gateway) -> dict[str, float]:
    return {name: metric_sum(gateway.metrics(), "gateway_backend_in_flight", backend=name)
            for name in ("eu-1", "us-1", "us-2")}


def _moved(gateway: Gateway) -> float:
    return metric_sum(gateway.metrics(), "gateway_migrations_total")


def _wait_rotation(gateway: Gateway, backend: str, healthy: bool, timeout_s: float) -> None:
    """Wait until the gateway has `backend` in rotation (`healthy`) or out of it."""
    deadline = time.monotonic() + timeout_s
    while bool(metric_sum(gateway.metrics(), "gateway_backend_healthy",
                          backend=backend)) != healthy:
        assert time.monotonic() < deadline, (
            f"{backend} {'did not come back' if healthy else 'stayed in rotation'}")
        time.sleep(0.2)


def test_streams_survive_a_front_that_restarts(gateway: Gateway, us_servers: list[TritonServer],
                                               long_reference: Reference) -> None:
    """Triton 2.51 never ends the requests a dead front stub held: the gateway sees the new
    front's start time on the server's metrics and moves the streams the old one held."""
    moved_before = _moved(gateway)
    streams = Streams(gateway)
    in_flight = _in_flight(gateway)
    server = us_servers[1]
    assert server.process is not None and in_flight["us-2"] > 0, in_flight
    [front] = [s for s in live_stubs(server.process.pid) if s.model == "front"]
    os.kill(front.pid, signal.SIGKILL)
    streams.finish(long_reference)
    moved = _moved(gateway) - moved_before
    print(f"streams open per server at the kill: {in_flight}; {moved:.0f} moved")
    assert 0 < moved <= in_flight["us-2"]
    _wait_rotation(gateway, "us-2", True, 60)  # the watchdog brought the front back


def test_streams_survive_a_server_that_stops_answering(
    gateway: Gateway, us_servers: list[TritonServer], long_reference: Reference,
) -> None:
    """us-2's tritonserver stopped (SIGSTOP): its connections stay open but nothing comes. After
    `unhealthy_after_s` (3 s) without an answer the gateway moves the streams it held."""
    moved_before = _moved(gateway)
    streams = Streams(gateway)
    in_flight = _in_flight(gateway)
    server = us_servers[1]
    assert server.process is not None and in_flight["us-2"] > 0, in_flight
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        streams.finish(long_reference)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    moved = _moved(gateway) - moved_before
    print(f"streams open per server when us-2 stopped: {in_flight}; {moved:.0f} moved")
    assert 0 < moved <= in_flight["us-2"]
    _wait_rotation(gateway, "us-2", True, 60)  # it answers again


def test_streams_survive_their_server_dying(gateway: Gateway, server: Server,
                                            us_servers: list[TritonServer],
                                            long_reference: Reference) -> None:
    client = gateway.openai(KEY).with_options(default_headers=US)
    moved_before = _moved(gateway)
    streams = Streams(gateway)
    in_flight = _in_flight(gateway)
    assert in_flight["eu-1"] == 0, in_flight  # us clients, us servers
    # The victim is the us server holding the most streams: least-loaded routing may have sent
    # them all to one (the other's metrics can still show the last test's moved streams).
    held = max(("us-1", "us-2"), key=lambda name: in_flight[name])
    assert in_flight[held] > 0, in_flight
    victim, survivor = us_servers if held == "us-1" else us_servers[::-1]
    left = "us-2" if held == "us-1" else "us-1"
    assert victim.process is not None
    os.kill(victim.process.pid, signal.SIGKILL)  # the whole server, with its streams
    streams.finish(long_reference)
    moved = _moved(gateway) - moved_before
    assert 0 < moved <= in_flight[held]  # (a stream may have finished before the kill)
    print(f"streams open per server at the kill: {in_flight}; {held} killed, {moved:.0f} moved")
    # new traffic from us goes to the us server left
    _wait_rotation(gateway, held, False, 10)
    before = _served(gateway, left)
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert _served(gateway, left) == before + 3
    assert wait_no_kv_blocks([server.options.metrics_url, survivor.options.metrics_url]) == 0
