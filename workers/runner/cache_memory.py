"""The device (and optional host) memory behind the cache managers; owned by the ModelRunner.

Device pools: KV blocks and recurrent state slots (`StateCaches`). Host tier: the same layouts in
host memory (pinned when a GPU is present), for blocks and snapshots the device pools evict. `apply`
performs the data moves a step plan carries (workers/cache/ops.py), in order.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hybridserve.workers.cache.ops import (
    CacheOp,
    CopyBlock,
    CopySlot,
    LoadBlock,
    LoadSlot,
    OffloadBlock,
    OffloadSlot,
)
from hybridserve.workers.runner.forward_batch import StateCaches

logger = logging.getLogger(__name__)

# Integer dtypes by element size: a tensor of any dtype (bf16 included, which numpy lacks)
# viewed as one of these has numpy's view of the same bytes and strides.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst` <- `src`. Between CPU tensors a plain copy on this thread alone (numpy), never
    torch's: cache ops run on whichever thread decided them (a transfer's receiving thread
    applies the evictions its reservation decided before the data lands), and a torch copy
    there gives that thread an OpenMP team of its own for the rest of its life. With more
    OpenMP threads than CPUs, libgomp makes every team sleep in its waits instead of
    spinning: a decode engine's step ran ~1.4x slower after its first received transfer on
    2 cores. Device copies are queued on the stream (host ones without waiting)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(_as_numpy(dst), _as_numpy(src))
    else:
        dst.copy_(src, non_blocking=True)


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(_SAME_SIZE_INT[tensor.element_size()]).numpy()


class CacheMemory:
    def __init__(
        self,
        device_caches: StateCaches,
        host_bytes: int,
        host_counts: tuple[int, int] | None = None,
    ) -> None:
        """`host_counts` (blocks, slots) fixes the host tier's size (every rank of an engine
        holds the same ids); otherwise it follows from `host_bytes`."""
        self.device = device_caches
        self.host: StateCaches | None = None
        self.num_host_blocks = 0
        self.num_host_slots = 0
        if host_bytes > 0:
            try:
                self.host = self._allocate_host(host_bytes, host_counts)
            except (RuntimeError, MemoryError) as exc:
                # A host tier that cannot be set up (memory, a memlock limit) is a lost
                # optimisation, never a failed start.
                logger.warning(
                    "host cache tier of %d bytes could not be set up (%s); running "
                    "with device caches only",
                    host_bytes,
                    exc,
                )
                self.host = None
                self.num_host_blocks = self.num_host_slots = 0

    @staticmethod
    def _bytes_per(t: torch.Tensor | None) -> int:
        return 0 if t is None or t.shape[0] == 0 else t[0].numel() * t.element_size()

    def _allocate_host(self, host_bytes: int, counts: tuple[int, int] | None = None) -> StateCaches:
        """Half the budget for KV blocks, half for state slots (all of it to whichever exists)."""
        device = self.device
        if counts is None:
            block_bytes = self._bytes_per(device.kv)
            slot_bytes = sum(self._bytes_per(pool) for pool in device.state.values())
            kv_share = 0.5 if block_bytes and slot_bytes else (1.0 if block_bytes else 0.0)
            counts = (
                int(host_bytes * kv_share) // block_bytes if block_bytes else 0,
                int(host_bytes * (1 - kv_share)) // slot_bytes if slot_bytes else 0,
            )
        self.num_host_blocks, self.num_host_slots = counts
        pin = torch.cuda.is_available() and device.kv is not None and device.kv.is_cuda

        def like(t: torch.Tensor | None, count: int) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.empty((count, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)

        state = {}
        for name, pool in device.state.items():
            host_pool = like(pool, self.num_host_slots)
            assert host_pool is not None
            state[name] = host_pool
        return StateCaches(kv=like(device.kv, self.num_host_blocks), state=state)

    # ---- cache ops ------------------------------------------------------------------------

    def apply(self, ops: list[CacheOp]) -> None:
        """Perform a step plan's data moves, in order."""
        for op in ops:
            if isinstance(op, CopyBlock):
                self.copy_block(op.src, op.dst, op.num_tokens)
            elif isinstance(op, CopySlot):
                self.copy_slot(op.src, op.dst)
            elif isinstance(op, OffloadBlock):
                self.offload_block(op.block_id, op.host_id)
            elif isinstance(op, LoadBlock):
                self.load_block(op.host_id, op.block_id)
            elif isinstance(op, OffloadSlot):
                self.offload_slot(op.slot, op.host_slot)
            else:
                assert isinstance(op, LoadSlot)
                self.load_slot(op.host_slot, op.slot)

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        kv = self.device.kv
        if kv is not None:  # (block, layer, k/v, kv_head, position, dim)
            copy_into(kv[dst, :, :, :, :num_tokens], kv[src, :, :, :, :num_tokens])

    def copy_slot(self, src: int, dst: int) -> None:
        for pool in self.device.state.values():
            copy_into(pool[dst], pool[src])

    def offload_block(self, block_id: int, host_id: int) -> None:
        assert self.host is not None
        if self.device.kv is not None:
            copy_into(self.host.kv[host_id], self.device.kv[block_id])

    def load_block(self, host_id: int, block_id: int) -> None:
        assert self.host is not None
        if self.device.kv is not None:
            copy_into(self.device.kv[block_id], self.host.kv[host_id])

    def offload_slot(self, slot: int, host_slot: int) -> None:
        assert self.host is not None
        for name, device_pool in self.device.state.items():
            copy_into(self.host.state[name][host_slot], device_pool[slot])

    def load_slot(self, host_slot: int, slot: int) -> None:
        assert self.host is not None
        for name, device_pool in self.device.state.items():
            copy_into(device_pool[slot], self.host.state[name][host_slot])
