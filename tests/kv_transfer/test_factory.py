import pytest

from python_backends.flag_board import BoardCache
from python_backends.kv_transfer.factory import TransportUnavailable, make_sinks, make_sources
from python_backends.kv_transfer.host_shm import HostShmSink
from python_backends.kv_transfer.layout import KVLayout, allocate_pool

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32",
                  num_blocks=4)


def test_unusable_transports_are_refused_by_name() -> None:
    pool = allocate_pool(LAYOUT)
    with pytest.raises(TransportUnavailable, match="cuda_ipc needs a CUDA engine"):
        make_sources(["cuda_ipc"], pool, "x")
    with pytest.raises(TransportUnavailable, match="shared memory"):
        make_sources(["host_shm"], pool, "x")
    with pytest.raises(TransportUnavailable, match="unknown KV transport 'carrier'"):
        make_sinks(["carrier"], LAYOUT, pool, "x", BoardCache())
    sinks = make_sinks(["host_shm"], LAYOUT, pool, "x", BoardCache())
    assert isinstance(sinks["host_shm"], HostShmSink)
