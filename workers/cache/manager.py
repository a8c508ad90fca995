"""HybridCacheManager: the scheduler's one door to KV blocks and Mamba slots."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.workers.cache.attention import AttentionBlockManager
from hybridserve.workers.cache.mamba import MambaStateManager
from hybridserve.workers.request import Request


@dataclass(frozen=True)
class Allocation:
    """What one `allocate` call added for a request."""

    new_block_ids: list[int]
    live_slot: int


class HybridCacheManager:
    def __init__(self, *, num_blocks: int, block_size: int, num_slots: int) -> None:
        self.blocks = AttentionBlockManager(num_blocks, block_size)
        self.states = MambaStateManager(num_slots)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.pool.num_free

    @property
    def num_free_slots(self) -> int:
        return self.states.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int) -> Allocation | None:
        """Room for the request's next `num_new_tokens`: a live slot (first time) and blocks.

        All or nothing: returns None and changes nothing if either pool is short.
        """
        request_id = request.request_id
        needs_slot = not self.states.has_slot(request_id)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if self.blocks.num_blocks_needed(request_id, num_tokens) > self.num_free_blocks or (
            needs_slot and self.num_free_slots == 0
        ):
            return None
        slot = self.states.allocate(request_id) if needs_slot else self.states.live_slot(request_id)
        return Allocation(self.blocks.allocate(request_id, num_tokens), slot)

    def block_table(self, request_id: str) -> list[int]:
        return self.blocks.block_table(request_id)

    def live_slot(self, request_id: str) -> int:
        return self.states.live_slot(request_id)

    def free(self, request: Request) -> None:
        self.blocks.free(request.request_id)
        self.states.free(request.request_id)

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        self.states.check_integrity()
