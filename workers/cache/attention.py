"""AttentionBlockManager: each request's block table over the shared KV block pool."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from hybridserve.workers.cache.block_pool import Block, BlockPool


class AttentionBlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, on_evict: Callable[[Block], None] | None = None
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, on_evict)
        self._tables: dict[str, list[int]] = {}

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so the request can hold `num_tokens` tokens. Side-effect free."""
        held = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - held)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover `num_tokens`; the new block ids, or None (and no
        change) if the pool is short."""
        new_ids = self.pool.allocate(self.num_blocks_needed(request_id, num_tokens))
        if new_ids is not None:
            self._tables.setdefault(request_id, []).extend(new_ids)
        return new_ids

    def append(self, request_id: str, block_ids: list[int]) -> None:
        """Put blocks the caller already holds (reused, promoted or copied) into the table."""
        self._tables.setdefault(request_id, []).extend(block_ids)

    def rename(self, request_id: str, new_id: str) -> None:
        self._tables[new_id] = self._tables.pop(request_id)

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def free(self, request_id: str) -> None:
        # Deepest first: the pool reuses least recently released blocks first, so a prefix's
        # tail is evicted before its head.
        self.pool.release(reversed(self._tables.pop(request_id, [])))

    def check_integrity(self) -> None:
        self.pool.check_integrity(Counter(b for table in self._tables.values() for b in table))
