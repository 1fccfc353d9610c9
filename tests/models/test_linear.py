"""The native float32 projection (csrc/linear.cpp) and the idle-CPU helper that shares its work
(csrc/idle_helper.h)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from python_backends.models import cpu_isa, kernels
from python_backends.models.weight_blocks import Blocks, find
from tests.models.test_weight_blocks import READ_AS, first_found, gguf_of, gguf_q4_1, gguf_q8_0


@pytest.fixture(scope="module")
def ops():
    assert kernels.load(), "the native kernels did not build here (see the warning logged)"
    return torch.ops.llm_kernels


@pytest.fixture
def helper(ops):
    """The helper on (the default); its state is put back after the test."""
    before = ops.set_idle_helper(True)
    yield
    ops.set_idle_helper(before)


# (rows, in_features, out_features): one token to prompt-sized, output features that fill no
# whole panel, that leave a partial last panel, and many panels (the work splits into chunks);
# from AMX_ROWS rows on AMX tiles where the CPU has them: row counts that fill no whole tile
# pair, and in_features that fill no whole tile; rows in several blocks (their pieces over a
# megabyte: 112 rows a block at 1536 in_features) with a short last one.
AMX_ROWS = 48
SHAPES = [(1, 64, 96), (5, 64, 7), (12, 576, 960), (13, 1536, 576), (40, 576, 4099),
          (1, 576, 49152), (AMX_ROWS, 576, 960), (65, 100, 70), (130, 1536, 576),
          (200, 40, 33), (700, 1536, 100)]


@pytest.mark.parametrize(("rows", "k", "n"), SHAPES)
def test_matches_float64(ops, helper, rows, k, n):
    g = torch.Generator().manual_seed(rows * 7 + n)
    w = torch.randn(n, k, generator=g) / k**0.5
    x = torch.randn(rows, k, generator=g)
    y = ops.linear(x, ops.pack_linear_weight(w), n)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=0, atol=2e-5)


def test_prompt_sized_calls_compute_on_amx_on_the_amx_path(ops):
    chosen = cpu_isa.path()
    assert ops.linear_amx() == (chosen is not None and chosen.name == "amx")


AFTER_ONEDNN = """
import torch
from python_backends.models import kernels
from python_backends.models.greedy_head import GreedyHead
kernels.load()
ops = torch.ops.llm_kernels
ops.set_idle_helper(False)  # every chunk on this thread, the one oneDNN releases the tiles of
g = torch.Generator().manual_seed(0)
w = torch.randn(300, 576, generator=g)
x = torch.randn(64, 576, generator=g)
packed, head = ops.pack_linear_weight(w), GreedyHead.build(w)
before = (ops.linear(x, packed, 300), head.tokens(x[:4]))
a = torch.randn(256, 256, dtype=torch.bfloat16)
(a @ a).sum().item()  # oneDNN's AMX kernel, which ends with TILERELEASE
after = (ops.linear(x, packed, 300), head.tokens(x[:4]))
print(torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]))
"""


def test_tiles_still_compute_after_another_library_released_them(ops):
    """torch's bfloat16 matmul (oneDNN on AMX) releases the thread's tiles; the next call of
    ours must configure them again, not fault (SIGILL, in a child so the suite survives)."""
    if not ops.linear_amx():
        pytest.skip("this CPU (or the capped path) has no AMX tiles")
    out = subprocess.run([sys.executable, "-c", AFTER_ONEDNN], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("rows", [9, AMX_ROWS + 3, 600])
def test_results_do_not_depend_on_who_computed_them(ops, helper, rows):
    """Chunks are computed by the caller or the helper with the same code: bit for bit equal,
    with the helper on, off, and whatever share it happened to take."""
    g = torch.Generator().manual_seed(0)
    w = ops.pack_linear_weight(torch.randn(3000, 576, generator=g))
    x = torch.randn(rows, 576, generator=g)
    ops.set_idle_helper(False)
    alone = ops.linear(x, w, 3000)
    ops.set_idle_helper(True)
    for _ in range(20):
        assert torch.equal(ops.linear(x, w, 3000), alone)


def test_a_weight_packed_again_in_place_is_read_anew(ops, helper):
    """A thread splits the next chunk's first panel ahead (csrc/linear.cpp, SplitPanels): never
    into a later call, even one reading the same memory with new weights in it."""
    kernel = kernels.native_linear()
    assert kernel is not None
    x = torch.randn(AMX_ROWS + 16, 576)
    packed = kernel.pack(torch.zeros(3000, 576))
    for seed in range(3):
        w = torch.randn(3000, 576, generator=torch.Generator().manual_seed(seed)) / 24
        kernel.pack(w, out=packed)
        got = kernel.op(x, packed, 3000, None, "").double()
        torch.testing.assert_close(got, x.double() @ w.double().T, rtol=0, atol=2e-5)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the helper needs a second CPU")
def test_the_helper_takes_chunks_when_a_cpu_is_idle(ops, helper):
    w = ops.pack_linear_weight(torch.randn(16384, 576))
    x = torch.randn(1, 576)
    helped = ops.idle_helper_stats()[1]
    deadline = time.monotonic() + 10
    while ops.idle_helper_stats()[1] == helped and time.monotonic() < deadline:
        ops.linear(x, w, 16384)
    assert ops.idle_helper_stats()[1] > helped


def test_switched_off_the_caller_computes_every_chunk(ops, helper):
    w = ops.pack_linear_weight(torch.randn(16384, 576))
    x = torch.randn(1, 576)
    ops.set_idle_helper(False)
    ops.linear(x, w, 16384)  # a job the helper may still be finishing from before
    time.sleep(0.05)
    helped = ops.idle_helper_stats()[1]
    for _ in range(20):
        ops.linear(x, w, 16384)
    assert ops.idle_helper_stats()[1] == helped


BOOSTED = """
import os, time, torch
from python_backends.models import kernels
assert kernels.load()
ops = torch.ops.llm_kernels
w = ops.pack_linear_weight(torch.randn(3072, 576))
prompt, step = torch.randn(200, 576), torch.randn(40, 576)  # more than 128 rows, and fewer
want = [ops.linear(x, w, 3072) for x in (prompt, step)]
for _ in range(20):  # steps alone are never boosted
    ops.linear(step, w, 3072)
time.sleep(0.05)  # a job the helper may still be finishing
after_steps = ops.idle_helper_stats()[3]
deadline = time.monotonic() + (1 if os.environ["LLM_HELPER_BOOST"] == "0" else 10)
while ops.idle_helper_stats()[3] == after_steps and time.monotonic() < deadline:
    assert torch.equal(ops.linear(prompt, w, 3072), want[0])
time.sleep(0.05)
print(after_steps, ops.idle_helper_stats()[3] - after_steps)
"""


def _may_leave_sched_idle() -> bool:
    code = ("import os; p = os.sched_param(0); os.sched_setscheduler(0, os.SCHED_IDLE, p); "
            "os.sched_setscheduler(0, os.SCHED_OTHER, p)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the helper needs a second CPU")
@pytest.mark.parametrize("boost", ["1", "0"])
def test_the_helper_computes_prompts_at_normal_priority(boost):
    """Calls of more than 128 rows (prompts) are heavy jobs: the helper leaves SCHED_IDLE for
    them, unless LLM_HELPER_BOOST=0 or the process may not (in a process of its own: the
    setting is read once)."""
    env = dict(os.environ, LLM_HELPER_BOOST=boost)
    out = subprocess.run([sys.executable, "-c", BOOSTED], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    before_prompts, by_prompts = map(int, out.stdout.split())
    assert before_prompts == 0
    assert (by_prompts > 0) == (boost == "1" and _may_leave_sched_idle())


FORKED = """
import os, sys, torch
from python_backends.models import kernels
assert kernels.load()
torch.set_num_threads(1)  # as engines do: OpenMP's threads do not survive a fork
ops = torch.ops.llm_kernels
w = ops.pack_linear_weight(torch.randn(8192, 576))
xs = [torch.randn(2, 576), torch.randn(64, 576)]  # on AMX tiles too, where the CPU has them
want = [ops.linear(x, w, 8192) for x in xs]  # the parent's helper is running now
pid = os.fork()
if pid == 0:
    ok = all(torch.equal(ops.linear(x, w, 8192), y) for _ in range(25)
             for x, y in zip(xs, want))
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_computes_with_a_helper_of_its_own(ops):
    """The child inherits the parent's helper object but not its thread: it must neither hang
    waiting for that thread nor compute wrongly."""
    out = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "child 0"


def test_callers_on_several_threads_each_get_their_own_results(ops, helper):
    """One caller at a time shares work with the helper; the others compute alone."""
    g = torch.Generator().manual_seed(1)
    w = ops.pack_linear_weight(torch.randn(4096, 576, generator=g))
    xs = [torch.randn(3, 576, generator=g) for _ in range(4)]
    ops.set_idle_helper(False)
    want = [ops.linear(x, w, 4096) for x in xs]
    ops.set_idle_helper(True)
    with ThreadPoolExecutor(4) as pool:
        for _ in range(10):
            got = list(pool.map(lambda x: ops.linear(x, w, 4096), xs))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_refuses_bad_arguments(ops):
    w = ops.pack_linear_weight(torch.randn(96, 64))
    x = torch.randn(3, 64)
    cases = [
        (lambda: ops.linear(x.double(), w, 96), "x float32"),
        (lambda: ops.linear(torch.randn(3, 32), w, 96), "x has 32 features"),
        (lambda: ops.linear(x, w, 200), "output features"),
        (lambda: ops.linear(x, w, 0), "output features"),
        (lambda: ops.linear(x[None], w, 96), "x float32 \\[T, K\\]"),
        (lambda: ops.pack_linear_weight(torch.randn(4, 4, 4)), "float32 CPU matrix"),
        (lambda: ops.pack_linear_weight(torch.randn(4, 4).half()), "float32 CPU matrix"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_fma_peak_is_a_plausible_rate_measured_inside_its_timing(ops):
    # Between 0.1 and 1000 GMAC/s on one thread: no CPU does more (two 512-bit FMA units at
    # 5 GHz: 160). A loop a compiler had moved out of the timed span reads ~1e16.
    rate = ops.fma_peak(200_000)
    assert 1e8 < rate < 1e12
    flops = kernels.fma_peak_flops()  # FLOP/s, two a multiply-add
    assert flops is not None and 2e8 < flops < 2e12
    with pytest.raises(RuntimeError, match="iterations must be positive"):
        ops.fma_peak(0)


def test_no_rows_give_no_rows(ops):
    w = ops.pack_linear_weight(torch.randn(96, 64))
    assert ops.linear(torch.empty(0, 64), w, 96).shape == (0, 96)


def test_strided_inputs_are_read_correctly(ops):
    w = torch.randn(96, 64)
    x = torch.randn(64, 6).T  # [6, 64], not contiguous
    torch.testing.assert_close(ops.linear(x, ops.pack_linear_weight(w), 96), x @ w.T,
                               rtol=1e-5, atol=1e-5)


def test_packs_into_memory_the_caller_gives(ops):
    kernel = kernels.native_linear()
    assert kernel is not None
    w = torch.randn(100, 64)
    shape = kernel.packed_shape(100, 64)
    assert shape[0] * shape[2] >= 100 > (shape[0] - 1) * shape[2] and shape[1] == 64
    arena = torch.full((3 + shape[0] * 64 * shape[2] + 3,), -1.0)
    packed = kernel.pack(w, out=arena[3:-3])
    assert packed.data_ptr() == arena[3:].data_ptr() and packed.shape == shape
    assert (arena[:3] == -1).all() and (arena[-3:] == -1).all()
    torch.testing.assert_close(kernel.op(torch.eye(64), packed, 100, None, ""), w.T)


# Weights made of GGUF blocks (models/weight_blocks.py): calls of up to 12 rows (one tile) read
# the blocks; more rows the float32 panels, or the blocks each panel unpacked once for every row
# tile (`unpack`: set_unpack_rows), row tiles partial and panels partial; from AMX_ROWS on AMX
# tiles where the CPU has them.
BLOCK_SHAPES = [(1, 64, 96), (3, 576, 960), (12, 576, 7), (5, 1536, 576), (8, 576, 40),
                (13, 576, 100), (25, 576, 70), (40, 64, 33), (47, 1536, 40), (600, 576, 40),
                (460, 1536, 40)]


@pytest.fixture(params=[False, True], ids=["panels", "unpacked"])
def unpack(ops, request):
    """Calls past a tile's rows from the float32 panels or the narrower forms unpacked, with
    AMX's levels (which compute in another order) switched off."""
    before = ops.set_unpack_rows(1 << 30 if request.param else 0)
    levels = ops.set_amx_levels(False)
    yield request.param
    ops.set_unpack_rows(before)
    ops.set_amx_levels(levels)


@pytest.fixture
def amx_levels(ops):
    """Calls of 13 to 128 rows from a weight's levels on AMX tiles (the default)."""
    before = ops.set_amx_levels(True)
    yield
    ops.set_amx_levels(before)


@pytest.mark.parametrize(("rows", "k"), [(600, 576), (700, 1536), (455, 576)])
def test_calls_in_blocks_of_rows_equal_each_tile_of_rows_alone(ops, helper, unpack, rows, k):
    """A call whose rows take more than a megabyte computes them in blocks of rows (csrc/linear.cpp,
    tile_block_rows; the last block shorter): every row bit for bit what a call of a tile's rows
    gives, from the float32 panels and from the blocks unpacked."""
    if ops.linear_amx():
        pytest.skip("calls of this many rows compute on AMX tiles on this CPU")
    w = gguf_q4_1(96, k, seed=rows)
    found = first_found(w)
    assert found is not None
    blocks = ops.pack_blocks(w, found.q, found.d, found.m, found.kind)
    packed = ops.pack_linear_weight(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    tiles = torch.cat([ops.linear(x[t:t + 12], packed, 96) for t in range(0, rows, 12)])
    assert torch.equal(ops.linear(x, packed, 96), tiles)
    assert torch.equal(ops.linear(x, packed, 96, blocks, found.kind), tiles)


def test_unpack_rows_is_set_and_read_back(ops):
    before = ops.set_unpack_rows(40)
    try:
        assert ops.set_unpack_rows(7) == 40
        with pytest.raises(RuntimeError, match="at least 0"):
            ops.set_unpack_rows(-1)
    finally:
        ops.set_unpack_rows(before)


@pytest.mark.parametrize("gguf", list(READ_AS))
@pytest.mark.parametrize(("rows", "k", "n"), BLOCK_SHAPES)
def test_calls_reading_the_blocks_equal_the_float_panels_bit_for_bit(ops, helper, unpack, rows,
                                                                      k, n, gguf):
    w = gguf_of(gguf, n, k, seed=rows)  # K-quants: k in whole super-blocks of 256
    k = w.shape[1]
    found = first_found(w)
    assert found is not None and found.kind == READ_AS[gguf]
    blocks = ops.pack_blocks(w, found.q, found.d, found.m, found.kind)
    assert blocks.numel() > 0
    packed = ops.pack_linear_weight(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(ops.linear(x, packed, n, blocks, found.kind), ops.linear(x, packed, n))
    # And x W^T within float32 summation's error bound (k roundings of 2^-24 of sum |x| |w|).
    error = (ops.linear(x, packed, n, blocks, found.kind).double()
             - x.double() @ w.double().T).abs()
    assert (error <= k * 2**-24 * (x.double().abs() @ w.double().abs().T)).all()


# Calls of 13 to 128 rows on AMX tiles from the levels (csrc/amx.h, level_product): partial row
# tiles, one and two row tiles a pass, partial panels, the largest such call; 129 rows and more
# split the float32 panels instead.
LEVEL_SHAPES = [(13, 576, 100), (16, 64, 33), (25, 1536, 70), (47, 576, 960), (100, 64, 40),
                (128, 576, 96), (129, 576, 64)]


@pytest.mark.parametrize("gguf", ["Q4_1", "Q4_K", "Q5_1", "Q8_0"])
@pytest.mark.parametrize(("rows", "k", "n"), LEVEL_SHAPES)
def test_calls_from_the_levels_stay_within_float32_error(ops, helper, amx_levels, rows, k, n,
                                                          gguf):
    """x W^T as d (x . q) + m (sum of x) per block: every product exact and every sum float32,
    so within float32 summation's bound of the float64 product, taken over the block's terms
    (|d q| and |m| apart: they may cancel in w); and bit for bit the same whoever computes which
    chunk."""
    w = gguf_of(gguf, n, k, seed=rows)
    k = w.shape[1]
    found = first_found(w)
    assert found is not None and found.kind == READ_AS[gguf]
    blocks = ops.pack_blocks(w, found.q, found.d, found.m, found.kind)
    packed = ops.pack_linear_weight(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = ops.linear(x, packed, n, blocks, found.kind)
    assert_within_block_terms_bound(ops, got, x, w, found)
    # On AMX these rows took the levels' path: another order of sums than the float32 panels
    # (129 rows of Q4_1 and Q5_1 too, from two pieces of each weight: the test below).
    tiles = rows <= 128 or gguf in ("Q4_1", "Q5_1")
    assert torch.equal(got, ops.linear(x, packed, n)) is not (ops.linear_amx() and tiles)


def assert_within_block_terms_bound(ops, got, x, w, found):
    """`got` (x W^T from the blocks `found`) within float32 summation's bound of the float64
    product, taken over the block's terms (|d q| and |m| apart: they may cancel in w); and bit for
    bit the same whoever computes which chunk."""
    k, n = x.shape[1], w.shape[0]
    group = k // found.d.shape[1]
    terms = (found.q.double() * found.d.double().repeat_interleave(group, 1)).abs()
    if found.m is not None:
        terms += found.m.double().abs().repeat_interleave(group, 1)
    error = (got.double() - x.double() @ w.double().T).abs()
    assert (error <= k * 2**-24 * (x.double().abs() @ terms.T)).all()
    ops.set_idle_helper(False)
    try:
        alone = ops.linear(x, ops.pack_linear_weight(w), n, ops.pack_blocks(
            w, found.q, found.d, found.m, found.kind), found.kind)
    finally:
        ops.set_idle_helper(True)
    assert torch.equal(alone, got)


# Calls of more than 128 rows on AMX tiles of weights whose every d q and m is two bfloat16
# pieces exactly (csrc/linear.cpp, LevelPieces: float16 d of 4- and 5-bit levels, Q4_0, Q4_1,
# Q5_0, Q5_1): five products, each row's block sums beside its inputs against the m. Several
# blocks of rows (300 of 1536 inputs), partial row tiles and panels, inputs of two blocks.
PIECE_SHAPES = [(129, 576, 100), (200, 64, 33), (300, 1536, 70), (150, 576, 960)]


@pytest.mark.parametrize("gguf", ["Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q8_0"])
@pytest.mark.parametrize(("rows", "k", "n"), PIECE_SHAPES)
def test_prompt_sized_calls_from_two_weight_pieces_stay_within_float32_error(
        ops, helper, amx_levels, rows, k, n, gguf):
    """Within float32's bound, as from the levels; a K-quant's d (float16 times a 6-bit scale)
    and Q8_0's 8-bit levels make more than two pieces, and those weights keep the float32
    panels."""
    w = gguf_of(gguf, n, k, seed=rows)
    k = w.shape[1]
    found = first_found(w)
    assert found is not None
    blocks = ops.pack_blocks(w, found.q, found.d, found.m, found.kind)
    packed = ops.pack_linear_weight(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = ops.linear(x, packed, n, blocks, found.kind)
    assert_within_block_terms_bound(ops, got, x, w, found)
    pieces = ops.linear_amx() and gguf in ("Q4_0", "Q4_1", "Q5_1")
    assert torch.equal(got, ops.linear(x, packed, n)) is not pieces


@pytest.mark.parametrize("field", ["d", "m"])
def test_one_scale_past_two_pieces_keeps_the_float_panels(ops, amx_levels, field):
    """One d of 21 significant bits (or m), where a float16's has 11: its d q is exact in
    float32 but not in two bfloat16 pieces, so the whole weight takes the float32 panels."""
    w = gguf_q4_1(64, 576, seed=3)
    found = find(w, "q4")
    assert found is not None and found.m is not None
    x = torch.randn(200, 576, generator=torch.Generator().manual_seed(1))
    packed = ops.pack_linear_weight(w)
    blocks = ops.pack_blocks(w, found.q, found.d, found.m, "q4")
    assert torch.equal(ops.linear(x, packed, 64, blocks, "q4"),
                       ops.linear(x, packed, 64)) is not ops.linear_amx()  # as found: two pieces
    scales = {"d": found.d.clone(), "m": found.m.clone()}
    scales[field][5, 2] *= 1 + 2**-20
    longer = Blocks("q4", found.q, scales["d"], scales["m"])
    w = longer.dequantize()
    blocks = ops.pack_blocks(w, longer.q, longer.d, longer.m, "q4")
    assert blocks.numel() > 0  # the blocks give back every weight
    packed = ops.pack_linear_weight(w)
    assert torch.equal(ops.linear(x, packed, 64, blocks, "q4"), ops.linear(x, packed, 64))


def test_amx_levels_switch_is_set_and_read_back(ops):
    before = ops.set_amx_levels(False)
    try:
        assert ops.set_amx_levels(True) is False
        assert ops.set_amx_levels(False) is ops.linear_amx()  # without AMX it stays off
    finally:
        ops.set_amx_levels(before)


def test_kinds_with_32_input_levels_report_the_amx_levels_path(ops):
    """Q4_0/Q4_1/Q4_K (q4), the 5-bit types (u8g32) and Q8_0 (q8); not Q6_K's 16-input
    groups, 16-bit weights or float32 alone; and nothing with the levels switched off."""
    before = ops.set_amx_levels(True)
    try:
        with_levels = {kind: ops.amx_levels_for(kind)
                       for kind in ("q4", "u8g32", "q8", "u8g16", "bf16", "f16", "")}
        assert with_levels == {kind: ops.linear_amx() and kind in ("q4", "u8g32", "q8")
                               for kind in with_levels}
        ops.set_amx_levels(False)
        assert not ops.amx_levels_for("q4")
    finally:
        ops.set_amx_levels(before)
    with pytest.raises(RuntimeError, match="unknown block layout"):
        ops.amx_levels_for("q3")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "k", "n"), BLOCK_SHAPES)
def test_calls_reading_16_bit_weights_equal_the_float_panels_bit_for_bit(ops, helper, unpack,
                                                                         rows, k, n, dtype):
    """A float32 weight that is 16-bit floats widened (a bfloat16 or float16 checkpoint)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(dtype).float()
    w[0, :3] = torch.tensor([0.0, -0.0, 1e-5]).to(dtype).float()  # zeros, a float16 subnormal
    halves = ops.pack_halves(w)
    panel = ops.pack_linear_weight(torch.zeros(1, 1)).shape[-1]
    assert halves.dtype == dtype and halves.shape == (-(-n // panel), k * panel)
    packed = ops.pack_linear_weight(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    kind = "bf16" if dtype == torch.bfloat16 else "f16"
    assert torch.equal(ops.linear(x, packed, n, halves, kind), ops.linear(x, packed, n))


def test_weights_that_are_not_16_bit_floats_are_not_packed_as_such(ops):
    w = torch.randn(40, 64).bfloat16().float()
    assert ops.pack_halves(w).dtype == torch.bfloat16
    w[7, 9] = torch.nextafter(w[7, 9], torch.tensor(9.0))  # one bit below bfloat16's
    assert ops.pack_halves(w).numel() == 0  # nor a float16: its exponent range is the float's
    assert ops.pack_halves(torch.randn(8, 64)).numel() == 0
    assert ops.pack_halves(torch.randn(8, 48).bfloat16().float()).numel() == 0  # K not in 32s
    big = torch.tensor([[2.0**17] + [0.0] * 31])  # a bfloat16, too large for a float16
    assert ops.pack_halves(big).dtype == torch.bfloat16


def test_blocks_that_do_not_give_back_the_weight_are_not_packed(ops):
    w = gguf_q4_1(40, 64)
    found = find(w, "q4")
    assert found is not None
    w[33, 5] = torch.nextafter(w[33, 5], torch.tensor(9.0))
    assert ops.pack_blocks(w, found.q, found.d, found.m, "q4").numel() == 0
    with pytest.raises(RuntimeError, match="q must be in"):
        ops.pack_blocks(w, found.q + 16, found.d, found.m, "q4")
    with pytest.raises(RuntimeError, match="q4 needs m"):
        ops.pack_blocks(w, found.q, found.d, None, "q4")
    with pytest.raises(RuntimeError, match="kind q4, q8, u8g32 or u8g16"):
        ops.pack_blocks(w, found.q, found.d, found.m, "q3")
    packed = ops.pack_linear_weight(w)
    with pytest.raises(RuntimeError, match="unknown block layout"):
        ops.linear(torch.randn(1, 64), packed, 40, torch.zeros(2, 3, dtype=torch.uint8), "q3")


def test_native_linear_finds_blocks_unless_switched_off(ops, monkeypatch):
    kernel = kernels.native_linear()
    assert kernel is not None
    weights = {"q4": gguf_q4_1(64, 64), "q8": gguf_q8_0(64, 64), "u8g16": gguf_of("Q6_K", 8, 256),
               "bf16": torch.randn(64, 64).bfloat16().float()}
    for kind, w in weights.items():
        found = kernel.blocks(w)
        assert found is not None and found.kind == kind and found.packed.numel() > 0
    assert kernel.blocks(torch.randn(64, 64)) is None
    monkeypatch.setenv(kernels.BLOCKS_ENV, "0")
    assert all(kernel.blocks(w) is None for w in weights.values())
