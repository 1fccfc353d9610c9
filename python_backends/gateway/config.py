"""The gateway's configuration: the Triton servers behind it, its API keys and tenants' rate
limits (the front's semantics and JSON form: front.admission.parse_rate_limits).

A JSON file (docs/gateway.md has a full example):

    {"model": "smollm2", "engine_dir": "engines/smollm2",
     "backends": [{"name": "eu-1", "grpc": "127.0.0.1:8001",
                   "metrics": "http://127.0.0.1:8002/metrics", "region": "eu", "weight": 1}],
     "api_keys": {"sk-team-a": "team-a"},
     "rate_limits": {"team-a": {"requests_per_s": 5}}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from python_backends.config import engine_dir_default, served_model_name
from python_backends.front.admission import RateLimit, parse_rate_limits
from python_backends.gateway.routing import DEFAULT_OVERLAP_WEIGHT

DEFAULT_PORT = 9000


class ConfigError(ValueError):
    """A configuration file the gateway cannot serve from; the message names the field."""


@dataclass(frozen=True)
class BackendConfig:
    """One Triton server serving this repository's `ensemble`."""

    name: str
    grpc: str  # host:port of its gRPC endpoint
    metrics: str  # URL of its metrics endpoint (load and engine health)
    region: str = "default"
    weight: float = 1.0  # a larger weight takes proportionally more load
    api_key: str | None = None  # the server's own --api-key, if it has one
    canary: bool = False  # serves the canary's share of users (RoutingConfig.canary_fraction)

    def __post_init__(self) -> None:
        if not self.name or not self.grpc or not self.metrics:
            raise ConfigError("backends: each needs a name, grpc and metrics")
        if self.weight <= 0:
            raise ConfigError(f"backends[{self.name}].weight: must be > 0, got {self.weight}")


@dataclass(frozen=True)
class RoutingConfig:
    """How servers are chosen (gateway.routing; docs/gateway.md, "Choosing a server")."""

    policy: str = "least_loaded"  # or "prefix_aware"
    # prefix_aware hashes prompts with each server's published KV block size; this one only
    # for a server that publishes none (a front-only server, its engines on others)
    prefix_block_tokens: int = 16
    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT  # prefix_aware: a block to compute / one held
    latency_bound_s: float | None = None  # prefer the client's region while TTFT p95 <= this
    canary_fraction: float = 0.0  # users sent to the canary servers first
    residency: dict[str, tuple[str, ...]] = field(default_factory=dict)  # tenant -> regions

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"routing.policy: one of {POLICIES}, got {self.policy!r}")
        if self.prefix_block_tokens < 1:
            raise ConfigError("routing.prefix_block_tokens: must be >= 1")
        if not 0.0 <= self.canary_fraction <= 1.0:
            raise ConfigError(f"routing.canary_fraction: must be in [0, 1], got "
                              f"{self.canary_fraction}")
        if self.latency_bound_s is not None and self.latency_bound_s <= 0:
            raise ConfigError("routing.latency_bound_s: must be > 0")

    @classmethod
    def from_dict(cls, raw: Any) -> RoutingConfig:
        if not isinstance(raw, dict):
            raise ConfigError("routing: must be an object")
        try:
            residency = {str(t): tuple(str(r) for r in regions)
                         for t, regions in raw.get("residency", {}).items()}
            return cls(**{**raw, "residency": residency})
        except (TypeError, AttributeError) as e:
            raise ConfigError(f"routing: {e}") from None


POLICIES = ("least_loaded", "prefix_aware")
# How a request enters a server (gateway.triton): "front" tokenizes in the server's
# preprocessing, calls its front directly and detokenizes here; "ensemble" goes through the
# ensemble as any Triton client does (one more hop per streamed chunk).
PIPELINES = ("front", "ensemble")


@dataclass(frozen=True)
class GatewayConfig:
    backends: tuple[BackendConfig, ...]
    # The name clients use (/v1/models); default: the engine's (config.served_model_name).
    model: str = ""
    # its tokenizer (chat template, token counts); default: $LLM_ENGINE_DIR, else serve.sh's
    engine_dir: Path = field(default_factory=engine_dir_default)
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant; empty: open
    rate_limits: dict[str, RateLimit] = field(default_factory=dict)
    health_interval_s: float = 1.0  # readiness and load are read this often per server
    unhealthy_after_s: float = 3.0  # a server silent this long leaves the rotation
    max_attempts: int = 3  # servers tried for a request that has produced nothing yet
    migration_limit: int = 3  # times a stream cut mid-way moves to another server
    request_timeout_s: float = 600.0
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    pipeline: str = "front"  # one of PIPELINES

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES:
            raise ConfigError(f"pipeline: one of {PIPELINES}, got {self.pipeline!r}")
        if not self.model:  # frozen: set once, here
            object.__setattr__(self, "model", served_model_name(self.engine_dir))
        if not self.backends:
            raise ConfigError("backends: at least one Triton server is needed")
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ConfigError(f"backends: names must be unique, got {names}")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts: must be >= 1")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GatewayConfig:
        known = {"backends", "model", "engine_dir", "api_keys", "rate_limits", "routing",
                 "health_interval_s", "unhealthy_after_s", "max_attempts", "migration_limit",
                 "request_timeout_s", "pipeline"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown field(s) {unknown}; known: {sorted(known)}")
        try:
            backends = tuple(BackendConfig(**b) for b in raw.get("backends", []))
        except TypeError as e:
            raise ConfigError(f"backends: {e}") from None
        api_keys = raw.get("api_keys", {})
        if not isinstance(api_keys, dict):
            raise ConfigError("api_keys: must be an object of key -> tenant")
        try:
            limits = parse_rate_limits(json.dumps(raw.get("rate_limits", {})))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"rate_limits: {e}") from None
        extra: dict[str, Any] = {
            k: raw[k] for k in ("model", "health_interval_s", "unhealthy_after_s",
                                "max_attempts", "migration_limit", "request_timeout_s",
                                "pipeline")
            if k in raw}
        if raw.get("engine_dir"):
            extra["engine_dir"] = Path(raw["engine_dir"])
        return cls(backends=backends,
                   api_keys={str(k): str(v) for k, v in api_keys.items()},
                   rate_limits=limits, routing=RoutingConfig.from_dict(raw.get("routing", {})),
                   **extra)

    @classmethod
    def load(cls, path: Path) -> GatewayConfig:
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: must hold a JSON object")
        return cls.from_dict(raw)
