"""Each model's config parameters as one frozen dataclass: the defaults live here and nowhere
else, and `parse` checks a model's parameters once, at load. An unknown key, or a value of the
wrong type or range, is refused with the parameter's name (Triton then refuses to load the
model). tests/serving/test_options.py checks every shipped config.pbtxt against these classes.

Triton gives every parameter as a string; an empty one means the default, since a config
cannot unset a parameter. No Triton import: the glue turns OptionError into its exception.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

# Parameters that ops.repository bumps to make Triton reload a model; they mean nothing else.
RELOAD_COUNTERS = frozenset({"restart_revision", "resize_revision"})
TRUE, FALSE = "true", "false"


class OptionError(ValueError):
    """A model parameter that cannot be used; the message names it."""


def _at_least(name: str, value: float, low: float) -> None:
    if value < low:
        raise OptionError(f"parameter {name} must be at least {low:g}, got {value:g}")


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise OptionError(f"parameter {name} must be above 0, got {value:g}")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise OptionError(f"parameter {name} must be one of {', '.join(allowed)}, "
                          f"got {value!r}")


@dataclass(frozen=True)
class TokenizerOptions:
    """preprocessing and postprocessing."""

    engine_dir: str = ""  # "" = $LLM_ENGINE_DIR, else the default engine (serve.sh builds it)


@dataclass(frozen=True)
class EngineOptions:
    """What every engine model (worker, decode, prefill) has."""

    engine_dir: str = ""
    # torch threads of the engine, all its ranks together: "auto" = every core but one
    cpu_threads: str = "auto"
    kv_cache_blocks: int = 1024
    # the most tokens one step computes (decode rows, then prompt chunks): 0 = the engine's
    # max_num_batched_tokens, a number below it lowers it
    max_num_batched_tokens: int = 0
    enable_prefix_caching: bool = True
    kv_store: str = "auto"  # auto: the server's kv_store model when it runs; off
    # comma-separated transports in order of preference, "auto" by the instance's kind, or ""
    kv_transports: str = ""

    def __post_init__(self) -> None:
        if self.cpu_threads != "auto" and (not self.cpu_threads.isdigit()
                                           or int(self.cpu_threads) < 1):
            raise OptionError("parameter cpu_threads must be auto or at least 1, got "
                                  f"{self.cpu_threads!r}")
        _at_least("kv_cache_blocks", self.kv_cache_blocks, 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 0)
        _one_of("kv_store", self.kv_store, ("auto", "off"))

    @property
    def threads(self) -> int:
        """cpu_threads as engine.ranks takes it: 0 for auto."""
        return 0 if self.cpu_threads == "auto" else int(self.cpu_threads)


# stream_interval auto: steps of this many sequences or more send each sequence's tokens two at
# a time. Every response crosses tritonserver twice and the front's and the gateway's processes
# (about a core-ms a response on a 2-core CPU, where such a step takes 50 ms or more); halving
# the responses served 1.16x the tokens at concurrency 32 (docs/engines.md, "Streaming").
AUTO_STREAM_BATCH, AUTO_STREAM_INTERVAL = 16, 2


@dataclass(frozen=True)
class GeneratorOptions(EngineOptions):
    """worker and decode: engines that stream tokens."""

    enable_chunked_prefill: bool = True
    # the longest prompt-lookup draft a greedy sequence proposes per step (0: off)
    num_speculative_tokens: int = 4
    # drafts follow each sequence's acceptance, none where they would not pay
    # (engine.speculative); false: every draft as long as a match allows
    adaptive_speculation: bool = True
    # decode steps replayed as CUDA graphs where the instance is on a GPU (engine.cuda_graphs)
    cuda_graphs: bool = True
    # admission weights by tenant, a JSON object of numbers ({"default": 1, "gold": 3})
    tenant_weights: str = "{}"
    drain_timeout_seconds: float = 60.0  # a reload waits this long for running sequences
    # a sequence's tokens go to the caller once this many are due (its first and last at
    # once); auto: 1, or AUTO_STREAM_INTERVAL in steps of at least AUTO_STREAM_BATCH sequences
    stream_interval: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least("num_speculative_tokens", self.num_speculative_tokens, 0)
        if self.stream_interval != "auto" and (not self.stream_interval.isdigit()
                                               or int(self.stream_interval) < 1):
            raise OptionError("parameter stream_interval must be auto or at least 1, got "
                              f"{self.stream_interval!r}")
        _at_least("drain_timeout_seconds", self.drain_timeout_seconds, 0)
        self.weights()  # refused now, not at the first request

    def interval(self, sequences: int) -> int:
        """stream_interval for a step that drew tokens for `sequences` sequences."""
        if self.stream_interval != "auto":
            return int(self.stream_interval)
        return AUTO_STREAM_INTERVAL if sequences >= AUTO_STREAM_BATCH else 1

    def weights(self) -> dict[str, float]:
        try:
            raw = json.loads(self.tenant_weights)
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            weights = {str(k): float(v) for k, v in raw.items()}
        except (ValueError, TypeError) as e:
            raise OptionError(f"parameter tenant_weights must be a JSON object of numbers: "
                              f"{e}") from None
        for tenant, weight in weights.items():
            _positive(f"tenant_weights[{tenant!r}]", weight)
        return weights


@dataclass(frozen=True)
class DecodeOptions(GeneratorOptions):
    """decode: a generator whose requests' KV arrives from prefill instances."""

    kv_transports: str = "auto"


@dataclass(frozen=True)
class PrefillOptions(EngineOptions):
    kv_cache_blocks: int = 512
    kv_transports: str = "auto"
    kv_lease_seconds: float = 30.0  # a handoff's blocks are freed after this if never pulled

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("kv_lease_seconds", self.kv_lease_seconds)


@dataclass(frozen=True)
class KVStoreOptions:
    engine_dir: str = ""
    size_mb: int = 512

    def __post_init__(self) -> None:
        _at_least("size_mb", self.size_mb, 1)


@dataclass(frozen=True)
class FrontOptions:
    worker_model: str = "worker"
    prefill_model: str = "prefill"
    decode_model: str = "decode"
    # the groups' servers when other servers serve them: host:port,... or dns:NAME:PORT; ""
    # reads $LLM_WORKER_SERVERS, $LLM_PREFILL_SERVERS, $LLM_DECODE_SERVERS (front.remote)
    worker_servers: str = ""
    prefill_servers: str = ""
    decode_servers: str = ""
    disaggregation_min_prompt_tokens: int = 256
    disaggregation_max_inflight_prefills: int = 8
    # auto disaggregates onto local CPU groups too (they share this machine's cores with the
    # worker: off by default, see serving.front.shares_cpu_cores)
    disaggregation_on_shared_cpu: bool = False
    max_concurrent_requests: int = 1024
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 65536
    rate_limits: str = ""  # front.admission.parse_rate_limits
    prefix_cache_shared_tenants: str = ""  # front.tenancy.CacheSharing
    migration_limit: int = 3
    engine_check_interval_seconds: float = 0.5
    client_probe_interval_seconds: float = 1.0

    def __post_init__(self) -> None:
        for name in ("disaggregation_min_prompt_tokens", "migration_limit"):
            _at_least(name, getattr(self, name), 0)
        for name in ("disaggregation_max_inflight_prefills", "max_concurrent_requests",
                     "max_waiting_requests", "max_waiting_tokens"):
            _at_least(name, getattr(self, name), 1)
        _positive("engine_check_interval_seconds", self.engine_check_interval_seconds)
        _positive("client_probe_interval_seconds", self.client_probe_interval_seconds)


Options = TypeVar("Options")


def parse(cls: type[Options], params: Mapping[str, str]) -> Options:
    """`cls` from a model's parameters (name -> string). Raises OptionError naming the first
    unknown parameter or bad value."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    types = typing.get_type_hints(cls)
    unknown = sorted(set(params) - set(fields) - RELOAD_COUNTERS)
    if unknown:
        raise OptionError(f"unknown parameter {unknown[0]} (this model takes "
                          f"{', '.join(sorted(fields))})")
    values: dict[str, Any] = {}
    for name, text in params.items():
        text = text.strip()
        if name in fields and text:
            values[name] = _convert(name, text, types[name])
    return cls(**values)


def _convert(name: str, text: str, kind: type) -> Any:
    if kind is bool:
        if text not in (TRUE, FALSE):
            raise OptionError(f"parameter {name} must be true or false, got {text!r}")
        return text == TRUE
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise OptionError(f"parameter {name} must be an integer, got {text!r}") from None
    if kind is float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise OptionError(f"parameter {name} must be a number, got {text!r}")
        return value
    return text
