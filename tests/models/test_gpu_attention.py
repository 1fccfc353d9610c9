"""The GPU's paged-attention kernels (Triton language) run on the CPU by Triton's interpreter:
the decode kernel against the gathered SDPA reference, over block tables in any order, grouped
heads, softcapping and rows of length 0; the write kernel skipping negative slots; and an engine
whose decode steps read the cache through them (as on a GPU) equal to Hugging Face.

Triton takes the interpreter only where TRITON_INTERPRET=1 is set before it is first imported,
so the suite runs these tests (and tests/engine/test_cuda_graphs.py's) again in a process of
their own with it set (the first test); on a GPU tests/engine/test_cuda_engine.py runs the
kernels compiled.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from python_backends.config import PROJECT_ROOT
from python_backends.models import gpu_attention, gpu_layer_ops
from python_backends.models.attention import DecodeBatch, gathered_decode_attention
from tests.conftest import TinyModel, prompts
from tests.engine.test_llm_engine import run_all

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton not installed"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # the interpreter's
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1 by "
                                 "test_the_kernels_under_the_interpreter")
# The kernels' own tests: compiled on a GPU, else interpreted.
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
kernel_test = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETED,
                                 reason="run under TRITON_INTERPRET=1 by "
                                 "test_the_kernels_under_the_interpreter")


@pytest.mark.skipif(INTERPRETED or DEVICE == "cuda", reason="this is the run it starts, or "
                    "a GPU compiles the kernels")
def test_the_kernels_under_the_interpreter() -> None:
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          __file__, "tests/engine/test_cuda_graphs.py"],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=PROJECT_ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-5000:]
    assert " failed" not in run.stdout and " passed" in run.stdout, run.stdout[-2000:]


def slots_of(tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The reference's [B, L] slots of each row's first lens[b] tokens."""
    out = torch.zeros(len(lens), max(int(lens.max()), 1), dtype=torch.long)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        out[b, :n] = tables[b].long()[pos // block_size] * block_size + pos % block_size
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (6, 2, 16, 4), (4, 4, 32, 16), (9, 3, 64, 16), (8, 1, 24, 8),
], ids=["gqa3", "mha", "smollm2", "mqa-d24"])
@pytest.mark.parametrize("softcap", [0.0, 20.0], ids=["plain", "softcap"])
@kernel_test
def test_decode_matches_gathered_sdpa(dtype: torch.dtype, heads: int, kv_heads: int,
                                      head_dim: int, block_size: int, softcap: float) -> None:
    g = torch.Generator().manual_seed(heads * head_dim + block_size)
    blocks = 48
    cache = torch.randn(2, blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    # Rows of one block, of many (the kernel reads 64 tokens an iteration: 1, 64, 65, 150
    # cross its edges), a row whose context ends on a block's last token, and padding (0).
    lens = torch.tensor([1, 64, 65, 150 // block_size * block_size, 150, 0], dtype=torch.int32)
    width = -(-int(lens.max()) // block_size)  # blocks of the longest row
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lens])
    tables = tables.to(torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    out = gpu_attention.decode_attention(q.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE),
                                         lens.to(DEVICE), block_size, scale, softcap).cpu()
    assert out.dtype == dtype and out.shape == q.shape
    real = lens > 0
    batch = DecodeBatch(torch.arange(int(real.sum())), slots_of(tables[real], lens[real],
                                                                block_size), lens[real].long())
    ref = gathered_decode_attention(q[real].float(), cache.float(), batch, scale, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[real].float(), ref, atol=tol, rtol=tol)
    assert not out[~real].any()  # a row of length 0 reads nothing and writes zeros


@kernel_test
def test_write_skips_negative_slots() -> None:
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 32, 3, 8, generator=g).to(DEVICE)
    qkv = torch.randn(4, 5 * 3 * 8, generator=g).to(DEVICE)  # k, v: views of a wider tensor
    k = qkv[:, 24:48].view(4, 3, 8)
    v = qkv[:, 48:72].view(4, 3, 8)
    slots = torch.tensor([5, -1, 31, 0], device=DEVICE)
    expected = cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[0, s], expected[1, s] = k[t], v[t]
    gpu_attention.write_kv(cache, k, v, slots)
    assert torch.equal(cache, expected)


@interpreted
def test_engine_over_block_tables_matches_hf(tiny_llama: TinyModel) -> None:
    """Decode rows carry block tables, not slots, wherever the kernels run (a GPU; here the
    interpreter), and greedy output is still Hugging Face's: the engine's own block tables,
    prefix-cached and chunked, read in place."""
    engine = tiny_llama.engine(num_kv_blocks=48)
    assert engine.runner.block_tables
    assert engine.runner.graphs is None  # the CPU captures nothing
    batch = prompts(4, seed=7, lo=3, hi=30)
    batch.append(batch[0] + [5, 6, 7])  # shares the first prompt's blocks
    assert run_all(engine, batch, 8) == [tiny_llama.greedy(p, 8) for p in batch]
    assert engine.blocks.num_used == 0


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_match_torch(dtype: torch.dtype) -> None:
    """models.gpu_layer_ops against the decoder's torch ops, as Hugging Face computes them."""
    from python_backends.models.common import RMSNorm, apply_rotary

    g = torch.Generator().manual_seed(5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ops = gpu_layer_ops.OPS
    x, delta = (torch.randn(5, 48, generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(48, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
    total, y = ops.add_rms_norm(x.to(DEVICE), delta.to(DEVICE), norm.weight.to(DEVICE), 1e-6)
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter truncates to bfloat16
        assert torch.equal(total.cpu(), x + delta)
    torch.testing.assert_close(total.cpu(), x + delta, atol=tol, rtol=tol)
    torch.testing.assert_close(y.cpu(), norm(x + delta), atol=tol, rtol=tol)
    torch.testing.assert_close(ops.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-6).cpu(),
                               norm(x), atol=tol, rtol=tol)

    heads, kv_heads, dim, t = 6, 2, 16, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = torch.randn(t, 1, dim // 2, generator=g)
    cos, sin = (f(torch.cat((angles, angles), -1)).to(dtype) for f in (torch.cos, torch.sin))
    cache = torch.zeros(2, 12, kv_heads, dim, dtype=dtype)
    slots = torch.tensor([3, -1, 0, 11])
    on = cache.to(DEVICE)
    q, k = ops.rope_write_kv(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), on,
                             slots.to(DEVICE), heads, kv_heads)
    q_ref = apply_rotary(qkv[:, : heads * dim].float().view(t, heads, dim), (cos.float(),
                                                                            sin.float()))
    k_ref = apply_rotary(qkv[:, heads * dim: (heads + kv_heads) * dim].float().view(
        t, kv_heads, dim), (cos.float(), sin.float()))
    v = qkv[:, (heads + kv_heads) * dim:].view(t, kv_heads, dim)
    torch.testing.assert_close(q.cpu().float(), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k.cpu().float(), k_ref, atol=tol, rtol=tol)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(on[0, s].cpu(), k[i].cpu()) and torch.equal(on[1, s].cpu(), v[i])
    assert not on[:, [1, 2, 4, 5, 6, 7, 8, 9, 10]].any()  # the -1 row wrote nothing

    gate_up = torch.randn(3, 2 * 40, generator=g).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up.to(DEVICE)).cpu(),
                               torch.nn.functional.silu(gate) * up, atol=tol, rtol=tol)
