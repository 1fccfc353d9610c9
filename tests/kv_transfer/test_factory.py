import pytest

from python_backends.flag_board import BoardCache
from python_backends.kv_transfer import nixl
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


def test_nixl_is_offered_gpu_memory_only_from_the_build_for_torchs_cuda(monkeypatch) -> None:
    monkeypatch.setattr(nixl, "build", lambda: "nixl_cu12")
    monkeypatch.setattr(nixl.torch.version, "cuda", "13.0")
    assert "another CUDA" in (nixl.vram_problem() or "")
    assert "install nixl-cu13" in (nixl.vram_problem() or "")
    monkeypatch.setattr(nixl.torch.version, "cuda", "12.8")
    assert nixl.vram_problem() is None
    monkeypatch.setattr(nixl.torch.version, "cuda", None)
    assert nixl.vram_problem() == "torch has no CUDA"
    monkeypatch.setattr(nixl, "build", lambda: None)
    assert nixl.vram_problem() == "NIXL is not installed"


def test_a_registration_that_never_returns_fails_in_bounded_time() -> None:
    import threading
    import time

    from python_backends.kv_transfer.base import Failure, TransferError

    never = threading.Event()
    start = time.monotonic()
    with pytest.raises(TransferError, match="not created within 0 s") as e:
        nixl._bounded(never.wait, 0.2, "agent")
    assert e.value.kind is Failure.TIMEOUT and time.monotonic() - start < 5
    never.set()
    with pytest.raises(ValueError, match="bad"):  # an error is the caller's, at once
        nixl._bounded(lambda: (_ for _ in ()).throw(ValueError("bad")), 5, "agent")
    assert nixl._bounded(lambda: 7, 5, "agent") == 7
