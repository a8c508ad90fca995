"""AttentionBlockManager: KV blocks. Each request's block table, the tree's cached blocks, and
their optional host-tier copies.

Reuse rule for attention: any prefix of a prefix-tree match is reusable. Full blocks are shared
as they are; a block used only partly (reuse ends inside it) gets a private copy of its first
rows, because the request goes on writing the rest of it.

    reused R = 40, block_size 16:
    tree:     [ node 0: 16 tok ][ node 1: 16 tok ][ node 2: 16 tok ]
    request:  [ shared block   ][ shared block   ][ copy of 8 rows | its own tokens ... ]

A block is held by every table that lists it (the pool's ref count); a cached block nobody
holds is free but keeps its data until the pool hands it out again. Then `_evict` moves it to
the host tier or, with no copy left anywhere, has the coordinator drop its node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from hybridserve.workers.cache.block_pool import Block, BlockPool
from hybridserve.workers.cache.host_tier import HostRegion
from hybridserve.workers.cache.ops import CacheOpLog, CopyBlock, LoadBlock, OffloadBlock
from hybridserve.workers.cache.prefix_tree import Match, TreeNode


class AttentionBlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        ops: CacheOpLog,
        *,
        num_host_blocks: int = 0,
        on_unbacked: Callable[[TreeNode], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.ops = ops
        self.pool = BlockPool(num_blocks, self._evict)
        self.host = (
            HostRegion("host KV blocks", num_host_blocks, self._drop_host_copy)
            if num_host_blocks
            else None
        )
        # Called when a tree node is left with no page anywhere: it must leave the tree.
        self.on_unbacked = on_unbacked
        self._tables: dict[str, list[int]] = {}
        # What the ranks do not know yet (they keep every table, runner/block_tables.py): per
        # request, the first table entry changed since its last chunk, and the requests freed
        # since the last plan.
        self._changed_from: dict[str, int] = {}
        self._released: list[str] = []
        # Host ids a running admission still reads from: never dropped meanwhile.
        self._pinned: set[int] = set()

    # ---- lookup ---------------------------------------------------------------------------

    def longest_hit(self, match: Match) -> int:
        """Tokens attention can reuse from `match`: all of them (every tree node has a page on
        the device or the host). Side-effect free."""
        return match.matched_len

    # ---- allocation -----------------------------------------------------------------------

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so the request can hold `num_tokens` tokens. Side-effect free."""
        held = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - held)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover `num_tokens`; the new block ids, or None (and no
        change) if the pool is short."""
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            return []  # most steps of a decode
        new_ids = self.pool.allocate(self.num_blocks_needed(request_id, num_tokens))
        if new_ids:
            table = self._tables.setdefault(request_id, [])
            self._changed_from.setdefault(request_id, len(table))
            table.extend(new_ids)
        elif new_ids is not None and request_id not in self._tables:
            self._set_table(request_id, [])
        return new_ids

    def can_take(self, nodes: Sequence[TreeNode], reused: int, num_tokens: int) -> bool:
        """Whether `take` would succeed. Side-effect free."""
        num_full = reused // self.block_size
        to_promote = sum(1 for n in nodes[:num_full] if n.block_id is None)
        num_new = -(-num_tokens // self.block_size) - num_full
        return to_promote + num_new <= self.pool.num_free - self._num_free_held(
            nodes[: num_full + 1]
        )

    def take(
        self, request_id: str, nodes: Sequence[TreeNode], reused: int, num_tokens: int
    ) -> list[int]:
        """Start the request's table with a reused prefix of `reused` tokens (`nodes` back its
        blocks) and room for `num_tokens` in all. The caller checked `can_take`. Returns the
        blocks allocated (the first is the private copy of a partly used block, if any)."""
        pool, bs = self.pool, self.block_size
        num_full = reused // bs
        shared = nodes[:num_full]
        partly_used = nodes[num_full] if reused % bs else None
        held = [n for n in (*shared, partly_used) if n is not None and n.block_id is not None]
        self._pinned = {n.host_block_id for n in nodes if n.host_block_id is not None}
        try:
            # 1. Hold the reused blocks first: from now on nothing can evict them.
            for node in held:
                pool.acquire(node.block_id)  # type: ignore[arg-type]
            # 2. Bring host-resident shared blocks back to the device.
            for node in shared:
                if node.block_id is None:
                    (block_id,) = pool.allocate(1) or ()
                    self._promote(node, block_id)
            new_ids = pool.allocate(-(-num_tokens // bs) - num_full)
            assert new_ids is not None, "take() without can_take()"
            # 3. The partly used block: a private copy of its first rows.
            if partly_used is not None:
                self._copy_rows(partly_used, new_ids[0], reused % bs)
                if partly_used in held:
                    pool.release([partly_used.block_id])  # type: ignore[list-item]
        finally:
            self._pinned = set()
        self._set_table(request_id, [*(n.block_id for n in shared), *new_ids])  # type: ignore[misc]
        return new_ids

    def take_received(
        self, request_id: str, held: Sequence[TreeNode], num_tokens: int
    ) -> list[int] | None:
        """A transferred request's table: the full blocks this engine already caches (`held`,
        device-resident) and new blocks for the rest of `num_tokens`. None if short."""
        num_new = -(-num_tokens // self.block_size) - len(held)
        if num_new > self.pool.num_free - self._num_free_held(held):
            return None
        for node in held:
            self.pool.acquire(node.block_id)  # type: ignore[arg-type]
        new_ids = self.pool.allocate(num_new)
        assert new_ids is not None
        self._set_table(request_id, [*(n.block_id for n in held), *new_ids])  # type: ignore[misc]
        return new_ids

    def fork(self, request_id: str, child_id: str, num_tokens: int) -> bool:
        """A copy of the request's first `num_tokens` tokens for `child_id`: its full blocks
        shared, a partly filled last block copied (both go on writing into their own). False
        (and no change) if no block is left for the copy.

            parent: [ block a ][ block b ][ c: 5 rows | its next tokens ... ]
            child:  [ block a ][ block b ][ d: copy of c's 5 rows | its own ... ]
        """
        table = self._tables[request_id]
        num_full, num_rows = divmod(num_tokens, self.block_size)
        copy = self.pool.allocate(1 if num_rows else 0)
        if copy is None:
            return False
        for block_id in table[:num_full]:
            self.pool.acquire(block_id)
        if num_rows:
            self.ops.append(CopyBlock(table[num_full], copy[0], num_rows))
        self._set_table(child_id, [*table[:num_full], *copy])
        return True

    def _num_free_held(self, nodes: Iterable[TreeNode | None]) -> int:
        """Cached blocks among `nodes` that sit in the free queue: holding them takes them out
        of it, so they do not count as free for the rest of an allocation."""
        blocks = self.pool.blocks
        return sum(
            1
            for n in nodes
            if n is not None and n.block_id is not None and blocks[n.block_id].ref_count == 0
        )

    # ---- caching (the coordinator's commit) ------------------------------------------------

    def cache_block(self, node: TreeNode, own_block: int) -> bool:
        """Give a new tree node its page. A full block is shared as it is (the request never
        writes it again); a partial one gets a copy, since the request keeps writing its own.
        False if no block is left for the copy (the node must not stay)."""
        pool = self.pool
        if node.is_full:
            assert pool.blocks[own_block].node is None
            self._attach(node, own_block)
            return True
        copy = pool.allocate(1)
        if copy is None:
            return False
        self.ops.append(CopyBlock(own_block, copy[0], node.num_tokens))
        self._attach(node, copy[0])
        pool.release(copy)  # owned by the tree alone: cached and evictable
        return True

    def share_existing(self, request_id: str, node: TreeNode, index: int) -> None:
        """Another request already published this full block: use the tree's copy from now on
        (same tokens, so the same K/V), which keeps every path node held by its requests."""
        pool = self.pool
        table = self._tables[request_id]
        own = table[index]
        if node.block_id is None:  # only on the host: our block becomes its device copy
            assert pool.blocks[own].node is None
            self._attach(node, own)
        elif node.block_id != own:
            pool.acquire(node.block_id)
            table[index] = node.block_id
            self._changed_from[request_id] = min(self._changed_from.get(request_id, index), index)
            pool.release([own])

    def _attach(self, node: TreeNode, block_id: int) -> None:
        node.block_id = block_id
        self.pool.blocks[block_id].node = node

    # ---- tables ---------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def table_update(self, request_id: str) -> tuple[int, list[int]]:
        """What the ranks lack of the request's table, for its next chunk: (the first entry
        changed since its last chunk, the entries from there on); the table counts as sent."""
        table = self._tables[request_id]
        start = self._changed_from.pop(request_id, len(table))
        return start, table[start:]

    def take_released(self) -> list[str]:
        """The requests freed since the last call: the ranks drop their tables."""
        released, self._released = self._released, []
        return released

    def _set_table(self, request_id: str, table: list[int]) -> None:
        self._tables[request_id] = table
        self._changed_from[request_id] = 0

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    def rename(self, request_id: str, new_id: str) -> None:
        self._set_table(new_id, self._tables.pop(request_id))
        self._changed_from.pop(request_id, None)
        self._released.append(request_id)

    def free(self, request_id: str) -> None:
        # Deepest first: the pool reuses least recently released blocks first, so a prefix's
        # tail is evicted before its head.
        table = self._tables.pop(request_id, None)
        if table is not None:
            self.pool.release(reversed(table))
            self._changed_from.pop(request_id, None)
            self._released.append(request_id)

    # ---- eviction and the host tier --------------------------------------------------------

    def release_node(self, node: TreeNode) -> None:
        """`node` leaves the tree: its device block becomes plain free, its host copy goes."""
        if node.block_id is not None:
            block = self.pool.blocks[node.block_id]
            assert block.ref_count == 0, "evicting a block a request still holds"
            block.node, node.block_id = None, None
        if node.host_block_id is not None:
            assert self.host is not None
            self.host.free(node.host_block_id)
            node.host_block_id = None

    def _evict(self, block: Block) -> None:
        """The pool hands out a cached block: keep its node on the host, or drop the node."""
        node = block.node
        assert node is not None
        block.node, node.block_id = None, None
        # NOTE: a node can already have a host copy (`share_existing` gave a host-only node a
        # device copy again); that copy stays valid, and a second one would leak.
        if self.host is not None and node.host_block_id is None:
            host_id = self.host.allocate(node, pinned=self._pinned)
            if host_id is not None:
                self.ops.append(OffloadBlock(block.block_id, host_id))
                node.host_block_id = host_id
                return
        if node.host_block_id is None:
            self._unbacked(node)

    def _drop_host_copy(self, node: TreeNode) -> None:
        node.host_block_id = None
        if node.block_id is None:
            self._unbacked(node)

    def _unbacked(self, node: TreeNode) -> None:
        assert self.on_unbacked is not None, "a cached block needs a coordinator"
        self.on_unbacked(node)

    def _promote(self, node: TreeNode, block_id: int) -> None:
        """A host-resident node: `block_id` (held by the caller) becomes its device copy."""
        assert self.host is not None and node.host_block_id is not None
        self.ops.append(LoadBlock(node.host_block_id, block_id))
        self.host.free(node.host_block_id)
        node.host_block_id = None
        self._attach(node, block_id)

    def _copy_rows(self, node: TreeNode, dst: int, num_tokens: int) -> None:
        if node.block_id is not None:
            self.ops.append(CopyBlock(node.block_id, dst, num_tokens))
        else:
            assert self.host is not None and node.host_block_id is not None
            self.ops.append(LoadBlock(node.host_block_id, dst))
            self.host.touch(node.host_block_id)

    # ---- checks ---------------------------------------------------------------------------

    def rank_table_problems(self, rank_tables: Mapping[str, list[int]]) -> list[str]:
        """A rank's tables (runner/block_tables.py) against these: equal wherever no change
        is waiting for the request's next chunk, and none for a request that is gone unless
        its release is waiting for the next plan."""
        problems = []
        released = set(self._released)
        for request_id, table in rank_tables.items():
            mine = self._tables.get(request_id)
            if mine is None and request_id not in released:
                problems.append(f"a rank still holds the table of {request_id}, which is gone")
            elif mine is not None and request_id not in self._changed_from and table != mine:
                problems.append(f"a rank's table of {request_id} is {table}, not {mine}")
        return problems

    def check_integrity(self, tree_nodes: Iterable[TreeNode]) -> list[str]:
        """Recount the pool against the tables; returns the tree-side problems found."""
        self.pool.check_integrity(Counter(b for table in self._tables.values() for b in table))
        if self.host is not None:
            self.host.check_integrity()
        problems, tree_blocks = [], set()
        for node in tree_nodes:
            if node.block_id is None and node.host_block_id is None:
                problems.append(f"node at block {node.ordinal} has no page")
            if node.block_id is not None:
                tree_blocks.add(node.block_id)
                if self.pool.blocks[node.block_id].node is not node:
                    problems.append(f"block {node.block_id} does not point back to its node")
        cached = {b.block_id for b in self.pool.blocks if b.node is not None}
        if cached != tree_blocks:
            problems.append(f"{len(cached ^ tree_blocks)} blocks cached outside the tree")
        return problems
