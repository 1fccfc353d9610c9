"""Options of the engine models (worker, decode, prefill) that need torch: kept out of
serving.common, which the front's torch-free stub imports."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import triton_python_backend_utils as pb_utils

from python_backends.engine.speculative import SpeculationConfig
from python_backends.kv_store.host_store import find_store
from python_backends.kv_store.tier import StoreTier
from python_backends.kv_transfer.layout import KVLayout
from python_backends.serving.common import ModelArgs


def cpu_threads(margs: ModelArgs) -> int:
    """The engine models' `cpu_threads` parameter: torch threads for the instance's engine, all
    its ranks together; `auto` (or empty): every core but one (engine.ranks.threads_per_rank).
    Engines that compute at the same time (prefill and decode under disaggregation, several
    instances) should share the cores between them: see docs/engines.md, "CPU threads"."""
    value = margs.param("cpu_threads", "auto").strip()
    if value == "auto":
        return 0
    n = margs.int_param("cpu_threads", 0)
    if n < 1:
        raise pb_utils.TritonModelException(
            f"{margs.model_name}: parameter cpu_threads must be auto or at least 1, got {value!r}")
    return n


def prefix_caching(margs: ModelArgs) -> dict[str, Any]:
    """The engine models' prefix-caching options: `enable_prefix_caching` (true) and `kv_store`
    (auto: use the server's kv_store model when it runs; off), as LLMEngine arguments."""
    enabled = margs.param("enable_prefix_caching", "true") == "true"
    use_store = enabled and margs.param("kv_store", "auto") == "auto"
    server = os.getppid()  # every stub's parent is the server

    def tier(pool: Any, layout: KVLayout) -> StoreTier:
        return StoreTier(partial(find_store, server), pool, layout)

    return {"enable_prefix_caching": enabled, "kv_tier": tier if use_store else None}


def speculation(margs: ModelArgs) -> SpeculationConfig:
    """The engine models' `num_speculative_tokens` parameter: the longest prompt-lookup draft a
    greedy sequence proposes per step (0: off; engine.speculative, docs/engines.md)."""
    value = margs.param("num_speculative_tokens", "0").strip()
    try:
        return SpeculationConfig(int(value))
    except ValueError:
        raise pb_utils.TritonModelException(
            f"{margs.model_name}: parameter num_speculative_tokens must be an integer >= 0, "
            f"got {value!r}") from None
