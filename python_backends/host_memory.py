"""Host memory on transparent huge pages, for the large tensors every step streams.

On 4 KiB pages a pass over a large tensor takes a page-table walk every 4 KiB, and the
hardware prefetchers stop at every page's end: weight streaming and NIXL pulls are markedly
faster on 2 MiB pages (docs/platform.md, "Figures behind the code"). Linux hands out
transparent huge pages for a range advised MADV_HUGEPAGE when its THP mode is "always" or
"madvise" (`/sys/kernel/mm/transparent_hugepage/enabled`); with "never" the memory is
ordinary, and everything works as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor of `numel` elements in a private anonymous mapping advised onto huge
    pages, its data 2 MiB-aligned (huge pages map only aligned 2 MiB ranges). Untouched pages
    read as zeros and cost no memory until written; the mapping lives as long as the tensor.
    One mapping for many small tensors (views into it) wastes less than one each: a mapping's
    last huge page is whole once touched."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    nbytes = numel * dtype.itemsize
    # Private: shared anonymous memory is shmem, which gets no huge pages here.
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    with contextlib.suppress(AttributeError, OSError):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()
    return torch.frombuffer(buffer, dtype=dtype, count=numel, offset=-base % HUGE_PAGE)


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim; nothing where
    the C library has none). Loading an engine frees its temporaries (plain weights, packing
    buffers) into the heap, where they would stay resident: ~220 MB for the default model."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
