import numpy as np
import pytest
import torch

from python_backends.kv_transfer.layout import KVLayout, allocate_pool, block_runs, byte_ranges

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32",
                  num_blocks=10)


def test_runs_merge_only_where_both_sides_are_consecutive() -> None:
    assert block_runs([3, 4, 5, 9], [0, 1, 7, 8]) == [(3, 0, 2), (5, 7, 1), (9, 8, 1)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1], [])


def test_byte_ranges_move_exactly_the_blocks() -> None:
    src = torch.randn(LAYOUT.shape)
    dst_layout = KVLayout(**{**LAYOUT.to_dict(), "num_blocks": 6})
    dst = allocate_pool(dst_layout)
    src_blocks, dst_blocks = [7, 8, 2], [5, 0, 1]
    s8, d8 = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    for so, do, n in byte_ranges(LAYOUT, dst_layout, src_blocks, dst_blocks).tolist():
        d8[do : do + n] = s8[so : so + n]
    bs = LAYOUT.block_size
    for sb, db in zip(src_blocks, dst_blocks, strict=True):
        assert torch.equal(dst[:, :, db * bs : (db + 1) * bs], src[:, :, sb * bs : (sb + 1) * bs])
    untouched = [b for b in range(6) if b not in dst_blocks]
    for b in untouched:
        assert not dst[:, :, b * bs : (b + 1) * bs].any()
    assert LAYOUT.bytes_for(3) == 3 * 2 * 3 * 4 * 2 * 4 * 4


def test_pool_in_a_buffer_and_layout_checks() -> None:
    buf = bytearray(LAYOUT.nbytes)
    pool = allocate_pool(LAYOUT, buf)
    pool[1, 0, 5] = 7.0
    assert np.frombuffer(buf, dtype=np.float32).sum() == 7.0 * LAYOUT.head_dim * 2
    other = KVLayout(**{**LAYOUT.to_dict(), "num_kv_heads": 1})
    assert "num_kv_heads" in (LAYOUT.incompatibility(other) or "")
    assert LAYOUT.incompatibility(KVLayout(**{**LAYOUT.to_dict(), "num_blocks": 3})) is None
    assert KVLayout.from_dict(LAYOUT.to_dict()) == LAYOUT
