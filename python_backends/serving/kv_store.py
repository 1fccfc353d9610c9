"""`kv_store`: owns the node's host-memory KV store (kv_store.host_store) for the server's
engine instances, which read and write it directly; this model creates it at load, removes it
at unload, publishes its gauges, and answers a status query (StoreQuery -> StoreStatus)."""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

import triton_python_backend_utils as pb_utils

from python_backends.config import EngineConfig
from python_backends.diagnostics import set_up_process
from python_backends.engine.loader import kv_layout
from python_backends.kv_store.host_store import HostKVStore, store_name
from python_backends.serving.common import ModelArgs, engine_path, response
from python_backends.serving.metrics import KVStoreMetrics
from python_backends.serving.options import KVStoreOptions
from python_backends.wire import StoreStatus

log = logging.getLogger(__name__)
PUBLISH_S = 1.0


class KVStoreModel:
    def initialize(self, args: dict[str, str]) -> None:
        margs = ModelArgs(args)
        set_up_process(margs.instance_name)
        options = margs.options(KVStoreOptions)
        config = EngineConfig.load(engine_path(options.engine_dir))
        block = kv_layout(config, 1, whole=True)
        size_mb = options.size_mb
        slots = size_mb * 2**20 // block.nbytes
        if slots < 1:
            raise pb_utils.TritonModelException(
                f"kv_store: size_mb {size_mb} holds no block of {block.nbytes} bytes")
        # Every stub's parent is the server: its engines find the store by that pid.
        self.store = HostKVStore.create(store_name(os.getppid(), os.getpid()),
                                        kv_layout(config, slots, whole=True))
        log.info("kv_store: %s, %d blocks of %d tokens (%d MiB)", self.store.name, slots,
                 block.block_size, slots * block.nbytes >> 20)
        self.metrics = KVStoreMetrics(margs.model_name)
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish, name="kv-store-metrics",
                                           daemon=True)
        self._publisher.start()

    def _publish(self) -> None:
        while True:
            self.metrics.publish(self.store.stats())
            if self._stop.wait(PUBLISH_S):
                return

    def execute(self, requests: list[Any]) -> list[Any]:
        stats = self.store.stats()
        status = json.dumps({"name": self.store.name, "blocks": stats.num_slots,
                             "used": stats.num_ready, "evictions": stats.num_evictions})
        return [response(StoreStatus(status), batched=False) for _ in requests]

    def finalize(self) -> None:
        self._stop.set()
        self._publisher.join(5)
        self.store.close()
