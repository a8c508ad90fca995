"""Host memory: state pools zeroed, the right shape and dtype, 2 MiB aligned and advised onto
transparent huge pages; weights moved there with their values."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridserve.workers.runner.host_memory import HUGE_PAGE_BYTES, place_on_huge_pages, zeroed_pool

CPU = torch.device("cpu")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags_at(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(bound, 16) for bound in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


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


THP_ON = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off"
)


@THP_ON
def test_large_pool_is_advised_for_huge_pages() -> None:
    """The whole pool sits in a mapping advised MADV_HUGEPAGE ("hg"): under THP=madvise an
    unadvised allocation gets 4 KiB pages only. Whether the kernel finds 2 MiB of contiguous
    memory at fault time is up to it (a fragmented host may back the pool later or never), so
    the advice is what this asserts, at the pool's first and last byte."""
    pool = zeroed_pool((16, HUGE_PAGE_BYTES), torch.uint8, CPU)
    first, last = pool.data_ptr(), pool.data_ptr() + pool.numel() - 1
    assert "hg" in vm_flags_at(first)
    assert "hg" in vm_flags_at(last)
    # The control is a fresh anonymous mapping of the same size: a torch.empty of it could land
    # in a range this process advised before (glibc reuses freed mappings' addresses).
    control = mmap.mmap(-1, 16 * HUGE_PAGE_BYTES)
    first_byte = ctypes.c_char.from_buffer(control)
    try:
        assert "hg" not in vm_flags_at(ctypes.addressof(first_byte) + HUGE_PAGE_BYTES)
    finally:
        del first_byte
        control.close()


def weights_module() -> nn.Module:
    """2.4 MiB of parameters in two dtypes, one of them tied into two places."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 96, bias=False))
    module.append(nn.Embedding(96, 1024, dtype=torch.bfloat16))
    module.tied = module[1].weight
    return module


def test_weights_move_into_one_aligned_buffer_with_their_values() -> None:
    module = weights_module()
    x = torch.randn(3, 512)
    params = list(module.parameters())
    before = [p.detach().clone() for p in params]
    with torch.inference_mode():
        expected = module[1](module[0](x))
    place_on_huge_pages(module)
    assert list(module.parameters()) == params  # the same Parameter objects, moved
    assert module.tied is module[1].weight
    starts = [p.data_ptr() for p in params]
    assert starts[0] % HUGE_PAGE_BYTES == 0 and all(start % 64 == 0 for start in starts)
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    for param, old in zip(params, before, strict=True):
        assert param.is_contiguous() and param.dtype == old.dtype
        assert torch.equal(param, old)
    with torch.inference_mode():
        assert torch.equal(module[1](module[0](x)), expected)


@THP_ON
def test_moved_weights_are_advised_for_huge_pages() -> None:
    module = weights_module()
    place_on_huge_pages(module)
    for param in module.parameters():
        assert "hg" in vm_flags_at(param.data_ptr())
        assert "hg" in vm_flags_at(param.data_ptr() + param.numel() * param.element_size() - 1)


def test_parameters_sharing_a_storage_stay_together() -> None:
    module = weights_module()
    shared = torch.randn(2, 512, 1024)
    module.first, module.second = (nn.Parameter(half, requires_grad=False) for half in shared)
    place_on_huge_pages(module)
    assert module.first.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    assert module.second.data_ptr() == module.first.data_ptr() + 512 * 1024 * 4
    assert module.tied.data_ptr() % HUGE_PAGE_BYTES == 0  # the first of the others, moved


def test_small_modules_stay_where_they_are() -> None:
    module = nn.Linear(8, 4)
    start = module.weight.data_ptr()
    place_on_huge_pages(module)
    assert module.weight.data_ptr() == start
