from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from python_backends.host_memory import HUGE_PAGE, huge_page_empty, trim_heap

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_under(address: int) -> int:
    """AnonHugePages (bytes) of this process's mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_huge_page_tensors_are_aligned_flat_and_writable(dtype: torch.dtype) -> None:
    numel = 3 * HUGE_PAGE // dtype.itemsize + 5
    t = huge_page_empty(numel, dtype)
    assert t.shape == (numel,) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()  # untouched anonymous memory reads as zeros
    t.fill_(3)
    assert (t == 3).all()
    assert huge_page_empty(0, dtype).numel() == 0


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off on this machine")
def test_written_huge_page_tensors_sit_on_huge_pages() -> None:
    t = huge_page_empty(4 * HUGE_PAGE // 4, torch.float32)
    t.fill_(1.0)
    # Every whole 2 MiB range is a huge page, unless the kernel found no free one (rare).
    assert huge_pages_under(t.data_ptr()) >= 2 * HUGE_PAGE


def test_the_mapping_lives_as_long_as_a_view_of_it() -> None:
    view = huge_page_empty(HUGE_PAGE, torch.uint8)[HUGE_PAGE // 2:]
    view.fill_(7)
    assert int(view.sum()) == 7 * HUGE_PAGE // 2


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_trim_heap_gives_freed_heap_memory_back_and_keeps_live_memory() -> None:
    blocks = [bytearray(b"\x01") * 65536 for _ in range(400)]  # 25 MiB of heap blocks
    kept = blocks[-1]  # the heap's top stays in use: free() alone returns nothing below it
    del blocks
    before = resident_bytes()
    trim_heap()
    assert before - resident_bytes() >= 16 << 20
    assert kept == bytearray(b"\x01") * 65536
