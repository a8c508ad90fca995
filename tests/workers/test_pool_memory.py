"""Host state pools: zeroed, the right shape and dtype, 2 MiB aligned, and on huge pages
where the kernel allows them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve.workers.pool_memory import HUGE_PAGE_BYTES, zeroed_pool

CPU = torch.device("cpu")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no AnonHugePages line")


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((3, 5), torch.float16),
        ((64, 2, 4, 16, 8), torch.bfloat16),
        ((9, 3, 1 << 19), torch.float32),
    ],
)
def test_pool_is_zeroed_contiguous_and_writable(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    pool = zeroed_pool(shape, dtype, CPU)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[-1].fill_(3)
    assert pool[-1].eq(3).all() and not pool[:-1].any()


def test_large_pool_starts_on_a_huge_page_boundary() -> None:
    pool = zeroed_pool((5, HUGE_PAGE_BYTES + 12), torch.uint8, CPU)
    assert pool.data_ptr() % HUGE_PAGE_BYTES == 0


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off"
)
def test_large_pool_is_backed_by_huge_pages() -> None:
    before = anon_huge_kib()
    pool = zeroed_pool((16, HUGE_PAGE_BYTES), torch.uint8, CPU)
    # Not all 32 MiB need be huge (the kernel may be short of contiguous memory), but an
    # unadvised 4 KiB allocation under THP=madvise would show none.
    assert anon_huge_kib() - before >= HUGE_PAGE_BYTES // 1024
    del pool
