"""BlockPool: physical KV blocks with reference counts and an LRU queue of free blocks.

A block is held by every running request whose block table lists it (`ref_count`). A block
with no holder is free; if it still backs a prefix-tree node it keeps its data (a cached block)
until the pool hands it out again, at which point `on_evict` lets the cache manager save or drop
that node first. Free blocks are handed out least recently released first, and requests release
their blocks deepest first, so a parent block always outlives its children.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridserve.workers.cache.prefix_tree import TreeNode


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # The prefix-tree node whose tokens this block holds; None for a private block.
    node: TreeNode | None = None


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[Block], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently released first (OrderedDict: O(1) removal from the middle
        # when a cached block is reused by a new request).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return sum(1 for b in self.blocks if b.node is not None)

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks with ref_count 1, evicting cached ones as needed; None if too few."""
        if count > len(self._free):
            return None
        ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.node is not None:
                assert self.on_evict is not None
                self.on_evict(block)
                assert block.node is None, "on_evict must detach the block from its node"
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def acquire(self, block_id: int) -> None:
        """One more holder (a request reusing a cached block)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} released more often than acquired"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def check_integrity(self, holders: Counter[int]) -> None:
        """`holders` counts, per block id, the block tables that list it."""
        problems = []
        for block in self.blocks:
            if block.ref_count != holders.get(block.block_id, 0):
                problems.append(
                    f"block {block.block_id}: ref_count {block.ref_count}, "
                    f"{holders.get(block.block_id, 0)} holders"
                )
            if (block.ref_count == 0) != (block.block_id in self._free):
                problems.append(f"block {block.block_id}: free queue disagrees with ref_count")
            if block.node is not None and block.node.block_id != block.block_id:
                problems.append(f"block {block.block_id}: its node points elsewhere")
        if problems:
            raise RuntimeError(
                f"KV block pool integrity check failed ({self.num_blocks} total, "
                f"{self.num_free} free): {'; '.join(problems[:5])}"
            )
