"""Zeroed state pools, on transparent huge pages when they live in host memory.

A pool is touched in whole blocks and slots and, on a disaggregated engine, read and written by
the transceiver in regions of a few hundred KiB to a few MiB. With 4 KiB pages a 256 MiB
transfer pins and walks 65,536 pages (UCX's CMA path pins page by page); with 2 MiB pages it is
128, and the copies themselves miss the TLB far less. On this project's 2-core VM that lifted
NIXL from ~35% to ~50-60% of memcpy at 256 MiB (bench/transfer.py).

Under THP=madvise Linux backs a page fault with a huge page only inside an advised, 2 MiB
aligned range (later collapsing is slow and not guaranteed), so the pool is carved out of an
over-allocated buffer that nothing has touched yet:

    buffer  |<- pad ->|<--------------- pool (2 MiB aligned, advised) --------------->|<- rest ->|
            ^ torch.empty (not yet faulted in)                          madvise, then zero_()

Where THP is off or madvise is unavailable the pool is the same tensor on ordinary pages: huge
pages are an optimisation, never a requirement. GPU pools are plain `torch.zeros`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>


@functools.cache
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask for transparent huge pages on [address, address + nbytes) (a refusal is logged)."""
    madvise = _madvise()
    if madvise is not None and madvise(address, nbytes, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed, contiguous pool of `shape`; host pools start on a 2 MiB boundary and ask for
    transparent huge pages (see the module docstring)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    buffer = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    pad = -buffer.data_ptr() % HUGE_PAGE_BYTES
    pool = buffer[pad : pad + nbytes]
    advise_huge_pages(pool.data_ptr(), nbytes)
    return pool.view(dtype).view(shape).zero_()
