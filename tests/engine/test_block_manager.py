import pytest

from python_backends.engine.block_manager import BlockManager, OutOfBlocks


def test_allocate_release_and_usage() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_used == 3 and bm.usage == 3 / 8
    bm.release(a)
    assert bm.num_used == 0 and bm.num_free == 8


def test_shared_block_is_freed_by_last_holder() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    (b,) = bm.allocate(1)
    bm.share(b)
    assert bm.ref_count(b) == 2
    bm.release([b])
    assert bm.num_used == 1
    bm.release([b])
    assert bm.num_used == 0


def test_errors() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(OutOfBlocks):
        bm.allocate(3)
    (b,) = bm.allocate(1)
    bm.release([b])
    with pytest.raises(ValueError, match="released more often"):
        bm.release([b])
    with pytest.raises(ValueError, match="free"):
        bm.share(b)
    assert bm.blocks_for(9) == 3 and bm.blocks_for(8) == 2
