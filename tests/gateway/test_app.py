"""The gateway's HTTP layer without servers: a path or method it does not serve gets OpenAI's
error shape (Triton's `{"error": ...}` under /v2/) with its status; a request's choices that
cannot all be opened leave no call open."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.testclient import TestClient

from python_backends.gateway.app import _open_calls, create_app
from python_backends.gateway.config import BackendConfig, GatewayConfig
from python_backends.gateway.errors import ApiError


@pytest.fixture
def client() -> TestClient:
    config = GatewayConfig(backends=(BackendConfig(name="a", grpc="127.0.0.1:1",
                                                   metrics="http://127.0.0.1:2/metrics"),))
    return TestClient(create_app(config, tokenizer=object()))  # no lifespan: no health loop


def test_an_unknown_path_is_a_404_in_openais_shape(client: TestClient) -> None:
    r = client.post("/v1/embeddings", json={"input": "x"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == 404 and error["message"] == "POST /v1/embeddings: Not Found"


def test_a_method_a_path_does_not_take_is_a_405(client: TestClient) -> None:
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    r = client.get("/v2/models/ensemble/generate")
    assert r.status_code == 405 and "Method Not Allowed" in r.json()["error"]


class FakeCall:
    def __init__(self, name: str) -> None:
        self.name, self.closed = name, False
        self.backend = type("B", (), {"name": "server-a"})()

    async def close(self) -> None:
        self.closed = True


class FakeGateway:
    """Opens a call per request, failing the ones named in `fail` (after the others of the
    same batch have opened, as a slow refusal would)."""

    def __init__(self, fail: set[str]) -> None:
        self.fail = fail
        self.calls: list[FakeCall] = []

    async def open(self, request: Any, arrived: float, prefer: str = "") -> FakeCall:
        if request in self.fail:
            await asyncio.sleep(0)
            raise ApiError(503, f"{request} refused")
        call = FakeCall(request)
        self.calls.append(call)
        return call


@pytest.mark.parametrize("fail", [{"p0-c1"}, {"p1-c0"}, {"p0-c2", "p1-c1"}])
def test_a_choice_that_cannot_open_closes_every_call_opened(fail: set[str]) -> None:
    gw = FakeGateway(fail)
    requests = [[f"p{i}-c{j}" for j in range(3)] for i in range(2)]
    with pytest.raises(ApiError, match="refused"):
        asyncio.run(_open_calls(gw, requests, 0.0))  # type: ignore[arg-type]
    assert gw.calls and all(c.closed for c in gw.calls)
    ok = FakeGateway(set())
    calls: list[Any] = asyncio.run(_open_calls(ok, requests, 0.0))  # type: ignore[arg-type]
    assert [c.name for c in calls] == [r for rs in requests for r in rs]
    assert not any(c.closed for c in ok.calls)
