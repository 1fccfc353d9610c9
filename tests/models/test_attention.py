"""Decode attention: the native kernel against the gathered torch path, and the dispatch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from python_backends.models import attention, kernels
from python_backends.models.attention import DecodeBatch

BLOCK = 16


def paged_batch(lens: list[int], num_blocks: int, seed: int = 0) -> DecodeBatch:
    """Contexts of `lens` tokens in blocks scattered over a pool of `num_blocks`, padded with
    slot 0 as the model runner pads them."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=g)
    longest = max(lens)
    slots = torch.zeros(len(lens), longest, dtype=torch.long)
    used = 0
    for row, n in enumerate(lens):
        nb = -(-n // BLOCK)
        mine = blocks[used : used + nb]
        used += nb
        slots[row, :n] = (mine[:, None] * BLOCK + torch.arange(BLOCK)).view(-1)[:n]
    return DecodeBatch(torch.arange(len(lens)), slots, torch.tensor(lens))


def reference(q: torch.Tensor, cache: torch.Tensor, d: DecodeBatch, scale: float) -> torch.Tensor:
    """Each sequence alone, its context sliced out in order, through float64 SDPA."""
    outs = []
    for b, n in enumerate(d.lens.tolist()):
        ctx = d.slots[b, :n]
        k = cache[0, ctx].transpose(0, 1).double()  # [K, n, D]
        v = cache[1, ctx].transpose(0, 1).double()
        o = F.scaled_dot_product_attention(q[b, :, None].double(), k, v, scale=scale,
                                           enable_gqa=True)
        outs.append(o[:, 0])
    return torch.stack(outs)


@pytest.fixture(scope="module")
def kernel():
    assert kernels.load(), "the native kernels did not build here (see the warning logged)"
    fn = kernels.paged_decode_attention()
    assert fn is not None
    return fn


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
# float32 heads of 64 and 128 take decode_heads (csrc/paged_attention.cpp; 4 and 2 query heads
# a pass), 32 the general vector path.
@pytest.mark.parametrize("head_dim", [64, 128, 32])
def test_kernel_matches_reference_and_torch_path(kernel, dtype, heads, kv_heads, head_dim):
    num_blocks = 64
    lens = [1, 17, 150, 33, 16, 64]
    d = paged_batch(lens, num_blocks)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, num_blocks * BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    got = kernel(q, cache, d.slots, d.lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, cache, d, scale)
    torch.testing.assert_close(got.double(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    gathered = attention.gathered_decode_attention(q, cache, d, scale)
    torch.testing.assert_close(got.double(), gathered.double(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_results_do_not_depend_on_the_threads_that_computed_them(kernel, dtype):
    """One torch thread: sequences are shared with the idle-CPU helper (csrc/idle_helper.h),
    several: split over the torch threads; bit for bit the same as one thread alone."""
    lens = [5, 140, 33, 16, 64, 1, 99, 7]
    d = paged_batch(lens, 64)
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 64 * BLOCK, 3, 64, generator=g).to(dtype)
    q = torch.randn(len(lens), 9, 64, generator=g).to(dtype)
    ops, threads = torch.ops.llm_kernels, torch.get_num_threads()
    before = ops.set_idle_helper(False)
    try:
        torch.set_num_threads(1)
        alone = kernel(q, cache, d.slots, d.lens, 0.125)
        ops.set_idle_helper(True)
        shared = [kernel(q, cache, d.slots, d.lens, 0.125) for _ in range(20)]
        torch.set_num_threads(2)
        split = kernel(q, cache, d.slots, d.lens, 0.125)
    finally:
        ops.set_idle_helper(before)
        torch.set_num_threads(threads)
    assert all(torch.equal(s, alone) for s in shared) and torch.equal(split, alone)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_register_kept_heads_match_the_general_vector_path_bit_for_bit(kernel, heads, kv_heads,
                                                                      head_dim):
    """Heads of 64 and 128 floats (32 under AVX2) take decode_heads, whose query heads share
    each row with their vectors in registers (docs/engines.md says: the same results bit for
    bit); 16 more zeros make a head size only the general vector path takes, and adding zeros
    changes no sum, so the two must agree exactly, one-slot contexts and ragged ones included."""
    lens = [1, 3, 4, 5, 17, 150, 33, 64]
    d = paged_batch(lens, 64, seed=4)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 64 * BLOCK, kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    got = kernel(q, cache, d.slots, d.lens, head_dim**-0.5)
    padded = kernel(F.pad(q, (0, 16)), F.pad(cache, (0, 16)), d.slots, d.lens, head_dim**-0.5)
    assert torch.equal(got, padded[..., :head_dim])


def test_kernel_reads_only_each_context(kernel):
    """Padding and slots outside a context never count: poisoning them changes nothing."""
    num_blocks, kv_heads, head_dim = 32, 3, 64
    d = paged_batch([5, 40, 21], num_blocks, seed=3)
    cache = torch.randn(2, num_blocks * BLOCK, kv_heads, head_dim)
    q = torch.randn(3, 9, head_dim)
    before = kernel(q, cache, d.slots, d.lens, 0.125)
    in_use = torch.zeros(num_blocks * BLOCK, dtype=torch.bool)
    for b, n in enumerate(d.lens.tolist()):
        in_use[d.slots[b, :n]] = True
    cache[:, ~in_use] = float("nan")
    after = kernel(q, cache, d.slots, d.lens, 0.125)
    assert torch.equal(before, after)


def test_kernel_refuses_bad_arguments(kernel):
    cache = torch.randn(2, 64, 3, 64)
    q = torch.randn(1, 9, 64)
    lens = torch.tensor([2])
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel(q, cache, torch.tensor([[0, 64]]), lens, 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        kernel(q, cache, torch.tensor([[0, 1]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(q.double(), cache, torch.tensor([[0, 1]]), lens, 1.0)
    with pytest.raises(RuntimeError, match="head sizes"):
        kernel(torch.randn(1, 8, 64), cache, torch.tensor([[0, 1]]), lens, 1.0)


def test_decode_attention_uses_the_kernel_or_falls_back(kernel, monkeypatch):
    num_blocks = 16
    d = paged_batch([3, 20], num_blocks)
    cache = torch.randn(2, num_blocks * BLOCK, 3, 64)
    q = torch.randn(2, 9, 64)
    calls = []

    def spy(*args):
        calls.append(args)
        return kernel(*args)

    monkeypatch.setattr(kernels, "paged_decode_attention", lambda: spy)
    native = attention.decode_attention(q, cache, d, 0.125)
    assert len(calls) == 1
    monkeypatch.setattr(kernels, "paged_decode_attention", lambda: None)
    torch_ops = attention.decode_attention(q, cache, d, 0.125)
    torch.testing.assert_close(native, torch_ops, atol=2e-5, rtol=2e-5)
    # a cache that is a strided view (not the pool's own layout) takes the torch path
    monkeypatch.setattr(kernels, "paged_decode_attention", lambda: spy)
    strided = torch.randn(2, num_blocks * BLOCK, 6, 64)[:, :, ::2]
    attention.decode_attention(q, strided, d, 0.125)
    assert len(calls) == 1


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("off", False),
                                      (" False ", False), ("no", False)])
@pytest.mark.parametrize("variable,read", [
    (kernels.SWITCH_ENV, kernels.enabled), (kernels.STACK_ENV, kernels.stack_enabled),
    (kernels.BLOCKS_ENV, lambda: kernels.switched_on(kernels.BLOCKS_ENV))])
def test_switch(monkeypatch, variable, read, value, on):
    """Every on/off switch of the kernels reads its variable the same way."""
    if value is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, value)
    assert read() is on


def test_a_failed_build_leaves_the_torch_ops(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCES", (broken,))
    monkeypatch.setattr(kernels, "NAME", "llm_kernels_broken_test")
    monkeypatch.setattr(kernels, "BUILD_ROOT", tmp_path / "build")
    monkeypatch.delenv(kernels.SWITCH_ENV, raising=False)
    assert kernels.load.__wrapped__() is False
    assert "engine CPU kernels unavailable" in caplog.text
    # the failed build was attempted under BUILD_ROOT, not in the repository's build directory
    assert kernels.build_dir().parent == tmp_path / "build"


def test_the_build_is_keyed_by_source(tmp_path, monkeypatch):
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int a;\n")
    b.write_text("int b;\n")
    monkeypatch.setattr(kernels, "SOURCES", (a,))
    first = kernels.build_dir()
    assert kernels.build_dir() == first
    monkeypatch.setattr(kernels, "SOURCES", (b,))
    assert kernels.build_dir() != first


BUILDER = """
import sys, torch
from pathlib import Path
from python_backends.models import kernels
kernels.BUILD_ROOT = Path(sys.argv[1])
assert kernels.load()
q, cache = torch.randn(1, 9, 64), torch.randn(2, 16, 3, 64)
out = torch.ops.llm_kernels.paged_decode_attention(q, cache, torch.tensor([[0, 1]]),
                                                   torch.tensor([2]), 0.125)
print("ok", tuple(out.shape))
"""


def test_concurrent_loads_build_once_past_a_stale_lock(tmp_path):
    """Engines loading at once on a fresh machine: one compiles, the other waits and loads its
    build; a lock file left by a builder that was killed stalls neither."""
    root = tmp_path / "kernels"
    directory = root / kernels.build_dir().name
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")  # torch's lock, as a killed builder leaves it
    env = {k: v for k, v in os.environ.items() if k != kernels.SWITCH_ENV}
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(root)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(out.strip().endswith("ok (1, 9, 64)") for out, _ in outs)
    assert sum("compiling the engine's CPU kernels" in err for _, err in outs) == 1
    assert (directory / f"{kernels.NAME}.so").exists()
