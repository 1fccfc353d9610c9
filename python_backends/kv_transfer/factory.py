"""Transports by name, for the models' `kv_transports` parameter."""

from __future__ import annotations

import torch

from python_backends.flag_board import BoardCache
from python_backends.kv_transfer import TRANSPORTS, nixl
from python_backends.kv_transfer.base import KVSink, KVSource
from python_backends.kv_transfer.layout import KVLayout


class TransportUnavailable(ValueError):
    pass


def check_names(kinds: list[str]) -> None:
    for kind in kinds:
        if kind not in TRANSPORTS:
            raise TransportUnavailable(
                f"unknown KV transport {kind!r} (known: {', '.join(TRANSPORTS)})"
            )


def _check_device(kind: str, pool: torch.Tensor) -> None:
    if kind == "cuda_ipc" and not pool.is_cuda:
        raise TransportUnavailable(
            "cuda_ipc needs a CUDA engine; this engine's KV pool is in host memory")
    if kind == "host_shm" and pool.is_cuda:
        raise TransportUnavailable("host_shm needs the KV pool in host memory")


def make_sources(
    kinds: list[str], pool: torch.Tensor, agent_name: str, shm_name: str | None = None
) -> dict[str, KVSource]:
    """The owner's sources over `pool`; host_shm needs the pool in the shared-memory file
    `shm_name` (see host_shm.SharedPool)."""
    check_names(kinds)
    sources: dict[str, KVSource] = {}
    for kind in kinds:
        _check_device(kind, pool)
        if kind == "host_shm":
            from python_backends.kv_transfer.host_shm import HostShmSource

            if shm_name is None:
                raise TransportUnavailable("host_shm needs the KV pool in shared memory")
            sources[kind] = HostShmSource(shm_name)
        elif kind == "cuda_ipc":
            from python_backends.kv_transfer.cuda_ipc import CudaIpcSource

            sources[kind] = CudaIpcSource(pool)
        else:
            sources[kind] = nixl.NixlSource(pool, nixl.agent_name(agent_name))
    return sources


def make_sinks(
    kinds: list[str], layout: KVLayout, pool: torch.Tensor, agent_name: str, boards: BoardCache
) -> dict[str, KVSink]:
    check_names(kinds)
    sinks: dict[str, KVSink] = {}
    for kind in kinds:
        _check_device(kind, pool)
        if kind == "host_shm":
            from python_backends.kv_transfer.host_shm import HostShmSink

            sinks[kind] = HostShmSink(layout, pool, boards)
        elif kind == "cuda_ipc":
            from python_backends.kv_transfer.cuda_ipc import CudaIpcSink

            sinks[kind] = CudaIpcSink(layout, pool, boards)
        else:
            sinks[kind] = nixl.NixlSink(layout, pool, nixl.agent_name(agent_name), boards)
    return sinks
