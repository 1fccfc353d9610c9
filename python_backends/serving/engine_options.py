"""Engine models' options as LLMEngine takes them (these need torch: kept out of
serving.common, which the front's torch-free stub imports)."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from python_backends.engine.speculative import SpeculationConfig
from python_backends.kv_store.host_store import find_store
from python_backends.kv_store.tier import StoreTier
from python_backends.kv_transfer.layout import KVLayout
from python_backends.serving.options import EngineOptions, GeneratorOptions


def prefix_caching(options: EngineOptions) -> dict[str, Any]:
    """`enable_prefix_caching` and `kv_store` as LLMEngine arguments."""
    use_store = options.enable_prefix_caching and options.kv_store == "auto"
    server = os.getppid()  # every stub's parent is the server

    def tier(pool: Any, layout: KVLayout) -> StoreTier:
        return StoreTier(partial(find_store, server), pool, layout)

    return {"enable_prefix_caching": options.enable_prefix_caching,
            "kv_tier": tier if use_store else None}


def speculation(options: GeneratorOptions) -> SpeculationConfig:
    """`num_speculative_tokens`, `adaptive_speculation`: prompt-lookup drafts
    (engine.speculative, docs/engines.md)."""
    return SpeculationConfig(options.num_speculative_tokens,
                             adaptive=options.adaptive_speculation)
