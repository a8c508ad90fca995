"""The data moves of cache ops (workers/runner/cache_memory.py). Oracle: the same moves done with
torch indexing on copies of the pools."""

from __future__ import annotations

import os

import pytest
import torch

from hybridserve.workers.cache.ops import CopyBlock, CopySlot, LoadSlot, OffloadBlock
from hybridserve.workers.runner.cache_memory import CacheMemory
from hybridserve.workers.runner.forward_batch import StateCaches
from tests.helpers import on_new_thread_with_torch_threads


def pools(dtype: torch.dtype, head_dim: int = 8) -> StateCaches:
    gen = torch.Generator().manual_seed(0)

    def filled(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    return StateCaches(
        kv=filled(4, 2, 2, 2, 16, head_dim),
        state={"conv": filled(3, 2, 24, 3), "ssm": filled(3, 2, 4, head_dim, 16)},
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_move_exactly_their_bytes(dtype):
    memory = CacheMemory(pools(dtype), host_bytes=1 << 20, host_counts=(2, 2))
    device, host = memory.device, memory.host
    assert host is not None
    expected_kv, expected_conv, expected_ssm = (
        t.clone() for t in (device.kv, device.state["conv"], device.state["ssm"])
    )
    memory.apply(
        [
            CopyBlock(src=0, dst=3, num_tokens=5),  # a block's first 5 positions only
            CopySlot(src=2, dst=0),
            OffloadBlock(block_id=1, host_id=1),
        ]
    )
    expected_kv[3, :, :, :, :5] = expected_kv[0, :, :, :, :5]
    expected_conv[0], expected_ssm[0] = expected_conv[2], expected_ssm[2]
    assert torch.equal(device.kv, expected_kv)
    assert torch.equal(device.state["conv"], expected_conv) and torch.equal(
        device.state["ssm"], expected_ssm
    )
    assert torch.equal(host.kv[1], device.kv[1])
    host.state["conv"][1].fill_(7)
    host.state["ssm"][1].fill_(-3)
    memory.apply([LoadSlot(host_slot=1, slot=1)])
    assert (device.state["conv"][1] == 7).all() and (device.state["ssm"][1] == -3).all()
    assert torch.equal(device.state["conv"][2], expected_conv[2])  # its neighbours untouched


def test_ops_applied_off_the_stepping_thread_start_no_openmp_team():
    """A transfer's receiving thread applies the ops its reservation decided. A torch copy
    of this size would start an OpenMP team on that thread (a new OS thread that stays);
    with more OpenMP threads than CPUs, every team's waits then sleep."""
    memory = CacheMemory(pools(torch.float32, head_dim=512), host_bytes=0)
    counts: list[int] = []

    def receiving_thread() -> None:
        before = len(os.listdir("/proc/self/task"))
        memory.apply([CopyBlock(src=0, dst=1, num_tokens=16), CopySlot(src=0, dst=1)])
        counts.append(len(os.listdir("/proc/self/task")) - before)

    on_new_thread_with_torch_threads(receiving_thread)
    assert counts == [0]
    assert torch.equal(memory.device.kv[1], memory.device.kv[0])
    assert torch.equal(memory.device.state["ssm"][1], memory.device.state["ssm"][0])
