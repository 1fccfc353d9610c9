"""The gateway's HTTP layer without servers: a path or method it does not serve gets OpenAI's
error shape (Triton's `{"error": ...}` under /v2/) with its status."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from python_backends.gateway.app import create_app
from python_backends.gateway.config import BackendConfig, GatewayConfig


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
