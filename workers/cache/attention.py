"""AttentionBlockManager: each request's block table over the KV block pool."""

from __future__ import annotations

from hybridserve.workers.cache.id_pool import IdPool


class AttentionBlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = IdPool("KV block pool", num_blocks)
        self._tables: dict[str, list[int]] = {}

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so the request can hold `num_tokens` tokens. Side-effect free."""
        held = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - held)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to cover `num_tokens`; returns the new block ids."""
        new_ids = self.pool.allocate(self.num_blocks_needed(request_id, num_tokens))
        self._tables.setdefault(request_id, []).extend(new_ids)
        return new_ids

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def free(self, request_id: str) -> None:
        self.pool.free(self._tables.pop(request_id, []))

    def check_integrity(self) -> None:
        self.pool.check_integrity([b for table in self._tables.values() for b in table])
