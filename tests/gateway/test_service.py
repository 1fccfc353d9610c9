"""The gateway's core on fake servers: tenants from API keys, rate limits as 429, and a request
a server fails before its first token passed to the next server (only when worth it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from python_backends.front.admission import RateLimit
from python_backends.gateway import service
from python_backends.gateway.backends import BackendPool
from python_backends.gateway.config import BackendConfig, GatewayConfig, RoutingConfig
from python_backends.gateway.errors import ApiError
from python_backends.gateway.metrics import GatewayMetrics
from python_backends.gateway.routing import RouteRequest
from python_backends.gateway.service import BackendRequest, Gateway
from python_backends.gateway.triton import Piece


def _gateway(**config: Any) -> Gateway:
    backends = tuple(BackendConfig(name=n, grpc=f"127.0.0.1:{i + 1}", metrics="http://x")
                     for i, n in enumerate(("a", "b", "c")))
    pool = BackendPool(GatewayConfig(backends=backends, **config))
    for i, b in enumerate(pool.backends.values()):  # all healthy, "a" least loaded
        b.client = FakeClient(b.name)
        b.ready, b.last_answer = True, float("inf")
        b.metrics = {"llm_num_requests_running": {frozenset(): float(i)}}
    return Gateway(pool.config, pool, tokenizer=None, metrics=GatewayMetrics())


class FakeClient:
    def __init__(self, name: str) -> None:
        self.name = name


def _fake_servers(monkeypatch: pytest.MonkeyPatch, errors: dict[str, ApiError]) -> list[str]:
    """Servers that fail as `errors` says (by name) or answer; returns the names tried."""
    tried: list[str] = []

    async def fake_stream(client: FakeClient, inputs: Any, parameters: Any, headers: Any,
                          timeout_s: float, breaker: Any = None,
                          tokenizer: Any = None) -> AsyncIterator[Piece]:
        name = client.name
        tried.append(name)
        if name in errors:
            raise errors[name]
        yield Piece(text=name, finish_reason="length")

    monkeypatch.setattr(service, "stream", fake_stream)
    return tried


def _open(gw: Gateway) -> service.Call:
    async def run() -> service.Call:
        request = BackendRequest({"text_input": "x"}, {}, RouteRequest("t"), "completions")
        call = await gw.open(request, 0.0)
        await call.close()
        return call

    return asyncio.run(run())


def test_a_server_that_fails_before_the_first_token_passes_the_request_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tried = _fake_servers(monkeypatch, {"a": ApiError(503, "no engine instance is left")})
    gw = _gateway()
    call = _open(gw)
    assert tried == ["a", "b"] and call.first.text == "b"
    assert all(b.in_flight == 0 for b in gw.pool.backends.values())
    assert gw.metrics.registry.get_sample_value("gateway_retries_total", {"backend": "b"}) == 1


def test_a_refusal_of_the_request_is_final(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = _fake_servers(monkeypatch, {"a": ApiError(400, "invalid input 'top_p'")})
    with pytest.raises(ApiError) as e:
        _open(_gateway())
    assert e.value.status == 400 and tried == ["a"]


def test_attempts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    down = ApiError(503, "Connection refused")
    tried = _fake_servers(monkeypatch, {n: down for n in "abc"})
    with pytest.raises(ApiError) as e:
        _open(_gateway(max_attempts=2))
    assert e.value.status == 503 and tried == ["a", "b"]


def test_no_healthy_server_is_503(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_servers(monkeypatch, {})
    gw = _gateway()
    for b in gw.pool.backends.values():
        b.ready = False
    with pytest.raises(ApiError) as e:
        _open(gw)
    assert e.value.status == 503


def test_tenants_come_from_api_keys() -> None:
    gw = _gateway(api_keys={"sk-a": "team-a"})
    assert gw.tenant({"authorization": "Bearer sk-a"}, user="someone") == "team-a"
    assert gw.tenant({"x-api-key": "sk-a"}, user=None) == "team-a"
    for headers in ({}, {"authorization": "Bearer nope"}):
        with pytest.raises(ApiError) as e:
            gw.tenant(headers, user=None)
        assert e.value.status == 401
    assert _gateway().tenant({}, user="someone") == "someone"
    assert _gateway().tenant({}, user=None) == "default"


def test_rate_limits_are_429() -> None:
    gw = _gateway(rate_limits={"t": RateLimit(requests_per_s=0.01, burst_requests=1)})
    gw.admit("t", 5, 5)
    with pytest.raises(ApiError) as e:
        gw.admit("t", 5, 5)
    assert e.value.status == 429 and "rate limited" in e.value.message
    gw.admit("other", 5, 5)  # other tenants are unaffected


def _scripted(monkeypatch: pytest.MonkeyPatch, scripts: dict[str, list[Piece | ApiError]],
              sent: list[tuple[str, dict[str, Any]]]) -> None:
    """Servers that stream their script: pieces, and an error where the stream breaks."""

    async def fake_stream(client: FakeClient, inputs: dict[str, Any], parameters: Any,
                          headers: Any, timeout_s: float,
                          breaker: Any = None, tokenizer: Any = None) -> AsyncIterator[Piece]:
        sent.append((client.name, inputs))
        for step in scripts[client.name]:
            if isinstance(step, ApiError):
                raise step
            yield step

    monkeypatch.setattr(service, "stream", fake_stream)


def _read_all(gw: Gateway) -> tuple[list[Piece], service.Call]:
    async def run() -> tuple[list[Piece], service.Call]:
        request = BackendRequest({"text_input": "x", "stream": True}, {}, RouteRequest("t"),
                                 "completions")
        call = await gw.open(request, 0.0)
        try:
            return [p async for p in call.pieces()], call
        finally:
            await call.close()

    return asyncio.run(run())


def test_a_stream_cut_midway_goes_on_on_another_server(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    _scripted(monkeypatch, {
        "a": [Piece("He", [1]), Piece("llo", [2]), ApiError(503, "Socket closed")],
        "b": [Piece(" wor", [3]), Piece("ld", [4], finish_reason="length")],
        "c": []}, sent)
    gw = _gateway()
    pieces, call = _read_all(gw)
    assert "".join(p.text for p in pieces) == "Hello world" and call.token_ids == [1, 2, 3, 4]
    assert [name for name, _ in sent] == ["a", "b"]
    assert sent[1][1]["resume_ids"] == [1, 2] and "resume_ids" not in sent[0][1]
    assert gw.metrics.registry.get_sample_value("gateway_migrations_total",
                                                {"backend": "b"}) == 1
    assert all(b.in_flight == 0 for b in gw.pool.backends.values())


def test_moves_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    cut = ApiError(503, "no engine instance is left")
    _scripted(monkeypatch, {n: [Piece("x", [7]), cut] for n in "abc"}, [])
    with pytest.raises(ApiError) as e:
        _read_all(_gateway(migration_limit=1))
    assert e.value.status == 503 and "moved 1 times" in e.value.message


def test_a_stream_its_server_lost_but_still_serves_may_go_back_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server's front restarted: the server is fine, so the move may pick it again (the
    only server of a single-server gateway, or still the least loaded)."""
    calls: list[tuple[str, dict[str, Any]]] = []
    replies: dict[str, list[list[Piece | ApiError]]] = {"a": [
        [Piece("He", [1]), ApiError(503, "the server lost the request: its front restarted",
                                    server_ok=True)],
        [Piece("llo", [2], finish_reason="length")]]}

    async def fake_stream(client: FakeClient, inputs: dict[str, Any], parameters: Any,
                          headers: Any, timeout_s: float,
                          breaker: Any = None, tokenizer: Any = None) -> AsyncIterator[Piece]:
        calls.append((client.name, inputs))
        for step in replies[client.name].pop(0):
            if isinstance(step, ApiError):
                raise step
            yield step

    monkeypatch.setattr(service, "stream", fake_stream)
    pieces, _ = _read_all(_gateway())
    assert "".join(p.text for p in pieces) == "Hello"
    assert [name for name, _ in calls] == ["a", "a"] and calls[1][1]["resume_ids"] == [1]


def test_a_refusal_midway_is_not_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    _scripted(monkeypatch, {"a": [Piece("x", [7]), ApiError(400, "invalid input 'x'")],
                            "b": [], "c": []}, sent)
    with pytest.raises(ApiError) as e:
        _read_all(_gateway())
    assert e.value.status == 400 and len(sent) == 1


def test_prompts_are_tokenized_only_when_something_reads_the_tokens() -> None:
    def tokenizer(text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    gw = _gateway(rate_limits={"t": RateLimit(tokens_per_s=100)})
    gw.tokenizer = tokenizer
    assert gw.tokens("hi", "t") == [104, 105]  # its token rate limit counts them
    assert gw.tokens("hi", "other") == []  # no limit on tokens, least-loaded routing
    prefix = _gateway(routing=RoutingConfig(policy="prefix_aware"))
    prefix.tokenizer = tokenizer
    assert prefix.tokens("hi", "other") == [104, 105]
