"""Triton's messages to statuses, and the configuration file's checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from python_backends.gateway.__main__ import load_config, parse_args
from python_backends.gateway.config import ConfigError, GatewayConfig
from python_backends.gateway.errors import from_triton


@pytest.mark.parametrize(("message", "status"), [
    ("rate limited: tenant 'a' is over 1 requests/s", 429),
    ("server overloaded: 300 requests waiting (limit 256); retry later", 503),
    ("invalid input 'top_p': must be in (0, 1], got 1.5", 400),
    ("front: bad request: boom", 400),
    ("the engine serving this request failed (x) and no engine instance is left", 503),
    ("Stub process 'worker_0_0' is not healthy.", 503),
    ("failed to connect to all addresses; Connection refused", 503),
    ("something odd", 500),
])
def test_triton_messages_map_to_statuses(message: str, status: int) -> None:
    error = from_triton(message)
    assert error.status == status and error.retryable == (status == 503)
    assert error.body()["error"]["message"] == message


def test_a_config_file_with_two_servers(tmp_path: Path) -> None:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps({
        "model": "smollm2",
        "backends": [{"name": "eu-1", "grpc": "127.0.0.1:1", "metrics": "http://x/metrics",
                      "region": "eu"},
                     {"name": "us-1", "grpc": "127.0.0.1:2", "metrics": "http://y/metrics",
                      "region": "us", "weight": 2}],
        "api_keys": {"sk-a": "team-a"},
        "rate_limits": {"team-a": {"requests_per_s": 2}},
    }))
    config = GatewayConfig.load(path)
    assert [b.region for b in config.backends] == ["eu", "us"]
    assert config.api_keys == {"sk-a": "team-a"}
    assert config.rate_limits["team-a"].requests_per_s == 2


@pytest.mark.parametrize(("raw", "field"), [
    ({"backends": []}, "backends"),
    ({"backends": [{"name": "a", "grpc": "h:1"}]}, "backends"),
    ({"backends": [{"name": "a", "grpc": "h:1", "metrics": "u", "weight": 0}]}, "weight"),
    ({"backends": [{"name": "a", "grpc": "h:1", "metrics": "u"}], "color": "red"}, "color"),
    ({"backends": [{"name": "a", "grpc": "h:1", "metrics": "u"}],
      "rate_limits": {"t": {"requests_per_s": -1}}}, "rate_limits"),
    ({"backends": [{"name": "a", "grpc": "h:1", "metrics": "u"}],
      "routing": {"policy": "random"}}, "routing.policy"),
    ({"backends": [{"name": "a", "grpc": "h:1", "metrics": "u"}],
      "routing": {"canary_fraction": 2}}, "routing.canary_fraction"),
    ({"backends": [{"name": "a", "grpc": "h:1", "metrics": "u"}],
      "routing": {"sticky": True}}, "routing"),
    ({"backends": [{"name": "a", "grpc": "h:1", "metrics": "u"}], "pipeline": "bls"},
     "pipeline"),
])
def test_bad_configs_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        GatewayConfig.from_dict(raw)


def test_the_engine_defaults_to_the_one_the_servers_use(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    """serve.sh and the container image name the engine in $LLM_ENGINE_DIR; a gateway given
    none must read its tokenizer there, not from the repository's default path."""
    raw = {"backends": [{"name": "a", "grpc": "h:1", "metrics": "http://h:2/metrics"}]}
    monkeypatch.setenv("LLM_ENGINE_DIR", str(tmp_path))
    assert GatewayConfig.from_dict(raw).engine_dir == tmp_path
    monkeypatch.delenv("LLM_ENGINE_DIR")
    assert GatewayConfig.from_dict(raw).engine_dir.name == "smollm2"


def test_the_model_name_defaults_to_the_engines(tmp_path: Path) -> None:
    """Clients ask for the engine's model by the name its build gave it (--served-model-name,
    else its directory's name); a config's `model` still overrides it."""
    import json

    backends = [{"name": "a", "grpc": "h:1", "metrics": "http://h:2/metrics"}]
    engine = tmp_path / "qwen-engine"
    engine.mkdir()
    raw: dict[str, object] = {"backends": backends, "engine_dir": str(engine)}
    assert GatewayConfig.from_dict(raw).model == "qwen-engine"  # no config.json yet
    (engine / "config.json").write_text(json.dumps({"model_name": "Qwen2.5-0.5B-Instruct"}))
    assert GatewayConfig.from_dict(raw).model == "Qwen2.5-0.5B-Instruct"
    assert GatewayConfig.from_dict({**raw, "model": "mine"}).model == "mine"


def test_the_command_line_picks_the_pipeline() -> None:
    backend = ["--backend", "127.0.0.1:8001,http://127.0.0.1:8002/metrics"]
    assert load_config(parse_args(backend)).pipeline == "front"
    assert load_config(parse_args([*backend, "--pipeline", "ensemble"])).pipeline == "ensemble"
    with pytest.raises(SystemExit):
        parse_args([*backend, "--pipeline", "bls"])
