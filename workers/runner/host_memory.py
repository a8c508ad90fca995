"""Host memory on transparent huge pages: the state pools, and the weights.

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

The weights go the same way once loaded (`place_on_huge_pages`): a decode step of a few
requests streams every weight once, and through 4 KiB pages that walk misses the TLB every
page. On the benchmark checkpoint (80 MB of fp32 weights, this project's 2-core VM) the native
one-row step's C call took 2.65 ms in the median against 3.06 ms on 4 KiB pages, two engines
in one process taking turns.

Where THP is off or madvise is unavailable the memory is the same on ordinary pages: huge
pages are an optimisation, never a requirement. GPU memory is left as it is.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import functools
import logging
import math
import sys
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_CACHE_LINE = 64
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


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of untouched host memory (uint8) that starts on a 2 MiB boundary, advised onto
    huge pages: the first write to each 2 MiB faults in a huge page."""
    buffer = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    pad = -buffer.data_ptr() % HUGE_PAGE_BYTES
    region = buffer[pad : pad + nbytes]
    advise_huge_pages(region.data_ptr(), nbytes)
    return region


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed, contiguous pool of `shape`; host pools start on a 2 MiB boundary and ask for
    transparent huge pages (see the module docstring)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    return huge_page_buffer(nbytes).view(dtype).view(shape).zero_()


def place_on_huge_pages(module: nn.Module) -> None:
    """Move `module`'s host parameters, one after another, into one buffer on huge pages; each
    keeps its values, shape and dtype, and starts on a cache line. Call it before anything
    holds a parameter's address (packed copies, kernels' weight tables). Each old storage is
    released as its parameter moves (the allocator may keep small ones for reuse). Parameters
    that share a storage with another parameter stay where they are: moved one by one they
    would no longer share it."""
    params = [p for p in module.parameters() if p.device.type == "cpu" and p.is_contiguous()]
    owners = collections.Counter(p.untyped_storage().data_ptr() for p in params)
    params = [p for p in params if owners[p.untyped_storage().data_ptr()] == 1]
    sizes = [_round_up(p.numel() * p.element_size(), _CACHE_LINE) for p in params]
    if sum(sizes) < HUGE_PAGE_BYTES:
        return
    buffer, offset = huge_page_buffer(sum(sizes)), 0
    with torch.no_grad():
        for param, size in zip(params, sizes, strict=True):
            nbytes = param.numel() * param.element_size()
            moved = buffer[offset : offset + nbytes].view(param.dtype).view(param.shape)
            moved.copy_(param)
            param.data = moved
            offset += size


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
