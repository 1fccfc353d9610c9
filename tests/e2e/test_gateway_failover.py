"""Two Triton servers behind one gateway, as two regions (eu: the session's server, us: one of
this module's own): a tenant pinned to eu is never served in us; us as a canary gets its share
of users; and when the us server dies with streams in flight every stream goes on on the other
server (the prompt and the tokens so far) with output identical to Hugging Face's, while new
traffic goes to the server left."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from python_backends.client import metric_sum
from python_backends.launcher import ServerOptions, TritonServer, free_port
from tests.e2e.conftest import (
    ENGINE_DIR,
    Gateway,
    Reference,
    Server,
    hf_greedy,
    start_gateway,
    stop_gateway,
)
from tests.e2e.test_gateway import MODEL

pytestmark = pytest.mark.e2e
KEY, PINNED_KEY = "sk-any", "sk-eu-bank"
STREAMS = [f"Story {i}: once upon a time, in a village by the sea," for i in range(8)]
LONG = 48
USERS = 1000


@pytest.fixture(scope="module")
def us_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    log = tmp_path_factory.mktemp("us") / "server.log"
    triton = TritonServer(ServerOptions(
        http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
        engine_dir=ENGINE_DIR, log_file=log, exit_timeout_s=5))
    triton.start()
    try:
        triton.wait_ready(timeout_s=600)
        yield triton
    finally:
        triton.stop()


@pytest.fixture(scope="module")
def gateway(server: Server, us_server: TritonServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    eu, us = server.options, us_server.options
    gw = start_gateway(tmp_path_factory.mktemp("gateway2"), {
        "model": MODEL, "engine_dir": str(ENGINE_DIR), "health_interval_s": 0.5,
        "backends": [{"name": "eu-1", "grpc": f"127.0.0.1:{eu.grpc_port}",
                      "metrics": eu.metrics_url, "region": "eu"},
                     {"name": "us-1", "grpc": f"127.0.0.1:{us.grpc_port}",
                      "metrics": us.metrics_url, "region": "us"}],
        "api_keys": {KEY: "anyone", PINNED_KEY: "eu-bank"},
        "routing": {"residency": {"eu-bank": ["eu"]}},
    })
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="module")
def long_reference() -> Reference:
    return hf_greedy(STREAMS, LONG)


def test_a_canary_gets_its_share_of_users(server: Server, us_server: TritonServer,
                                          tmp_path: Path) -> None:
    """us-1 as a 10% canary: 1000 users, one request each, through a gateway of its own."""
    eu, us = server.options, us_server.options
    gw = start_gateway(tmp_path, {
        "model": MODEL, "engine_dir": str(ENGINE_DIR),
        "backends": [{"name": "eu-1", "grpc": f"127.0.0.1:{eu.grpc_port}",
                      "metrics": eu.metrics_url, "region": "eu"},
                     {"name": "us-1", "grpc": f"127.0.0.1:{us.grpc_port}",
                      "metrics": us.metrics_url, "region": "us", "canary": True}],
        "routing": {"canary_fraction": 0.1}})
    try:
        def one(i: int) -> int:
            r = requests.post(f"{gw.url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 1, "user": f"user-{i}"})
            return r.status_code

        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(one, range(USERS)))
        assert statuses == [200] * USERS
        on_canary = _served(gw, "us-1")
        assert on_canary + _served(gw, "eu-1") == USERS
        print(f"canary share: {on_canary / USERS:.1%} of {USERS} users")
        assert 0.07 * USERS <= on_canary <= 0.13 * USERS
    finally:
        stop_gateway(gw)


def _served(gw: Gateway, backend: str) -> float:
    return metric_sum(gw.metrics(), "gateway_requests_total", backend=backend, status="200")


def _finished(metrics_url: str) -> float:
    from python_backends.client import scrape

    return metric_sum(scrape(metrics_url), "llm_requests_finished_total")


def test_a_pinned_tenant_is_never_served_outside_its_region(
    gateway: Gateway, server: Server, us_server: TritonServer,
) -> None:
    us_before = _finished(us_server.options.metrics_url)
    eu_before = _finished(server.options.metrics_url)
    client = gateway.openai(PINNED_KEY)
    for i in range(6):
        client.completions.create(model=MODEL, prompt=f"Fact {i}:", max_tokens=2)
    assert _finished(us_server.options.metrics_url) == us_before  # never in us
    assert _finished(server.options.metrics_url) == eu_before + 6
    # other tenants are spread over both regions
    anyone = gateway.openai(KEY)
    threads = [threading.Thread(target=lambda i=i: anyone.completions.create(
        model=MODEL, prompt=f"Tale {i}:", max_tokens=8)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert _finished(us_server.options.metrics_url) > us_before


def test_streams_survive_their_server_dying(gateway: Gateway, server: Server,
                                            us_server: TritonServer,
                                            long_reference: Reference) -> None:
    client = gateway.openai(KEY)
    texts = ["" for _ in STREAMS]
    started = [threading.Event() for _ in STREAMS]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for event in client.completions.create(model=MODEL, prompt=STREAMS[i],
                                                   max_tokens=LONG, temperature=0,
                                                   stream=True):
                texts[i] += event.choices[0].text if event.choices else ""
                started[i].set()
        except BaseException as e:  # reported below
            errors.append(e)
            started[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(STREAMS))]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)
    on_us = metric_sum(gateway.metrics(), "gateway_backend_in_flight", backend="us-1")
    assert us_server.process is not None
    os.kill(us_server.process.pid, signal.SIGKILL)  # the whole server, with its streams
    for t in threads:
        t.join(180)
    assert not errors, errors
    for i, prompt in enumerate(STREAMS):
        assert texts[i] == long_reference.text(prompt), i
    moved = metric_sum(gateway.metrics(), "gateway_migrations_total", backend="eu-1")
    assert 0 < moved <= on_us  # (a stream may have finished before the kill)
    # new traffic goes to the server left
    deadline = time.monotonic() + 10
    while metric_sum(gateway.metrics(), "gateway_backend_healthy", backend="us-1"):
        assert time.monotonic() < deadline, "the dead server stayed in rotation"
        time.sleep(0.2)
    before = _served(gateway, "eu-1")
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert _served(gateway, "eu-1") == before + 3
    assert server.wait_idle(timeout=20) == 0
