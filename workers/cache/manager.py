"""HybridCacheManager: the scheduler's one door to KV blocks, Mamba slots and prefix reuse.

It answers four questions, each in one method:
- where must this request's chunks end?            `snapshot_points`  (spec 2.3)
- how much of its prompt can it reuse?             `find_reuse`       (spec 2.6)
- room for its next chunk (and the reuse itself)?  `allocate`
- what becomes reusable after this step?           `commit`           (spec 2.4)

Reuse of a hybrid prefix needs both halves at one position R: attention blocks covering
[0, R) and a Mamba snapshot taken after exactly R tokens. The prefix tree holds both; the
attention manager and the Mamba manager own the pools behind them.

    prompt:      [ reused: R tokens              | computed from the snapshot ... | last ]
    KV blocks:   [ shared tree blocks | CoW copy ][ new private blocks ...              ]
    Mamba state: snapshot(R) copied into the live slot, then advanced chunk by chunk
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from hybridserve.workers.cache.attention import AttentionBlockManager
from hybridserve.workers.cache.block_pool import Block
from hybridserve.workers.cache.events import (
    BlockRemoved,
    BlockStored,
    CacheEvent,
    SnapshotRemoved,
    SnapshotStored,
)
from hybridserve.workers.cache.hashing import block_hash
from hybridserve.workers.cache.host_tier import HostTier
from hybridserve.workers.cache.mamba import MambaStateManager
from hybridserve.workers.cache.ops import CacheOpExecutor
from hybridserve.workers.cache.prefix_tree import PrefixTree, Snapshot, TreeNode
from hybridserve.workers.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixCachingConfig:
    enabled: bool = False
    snapshot_interval: int = 0
    save_last_snapshot: bool = True
    partial_reuse: bool = True
    offsets_from_start: tuple[int, ...] = ()
    offsets_from_end: tuple[int, ...] = ()
    # False for a model without Mamba layers: any attention match is then reusable.
    requires_snapshot: bool = True
    # Publish a finished request's prompt + output and the state after them (the next turn
    # of a conversation extends exactly that sequence).
    snapshot_turn_end: bool = False


@dataclass
class CacheStats:
    """Prefix lookups of admitted requests (spec 2.6 stats)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    unreused_tokens: int = 0
    aligned_hits: int = 0
    unaligned_hits: int = 0

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(asdict(self).values())


@dataclass(frozen=True)
class Reuse:
    """What a request can take from the cache; side-effect free to compute."""

    num_tokens: int  # R
    nodes: tuple[TreeNode, ...]  # nodes backing blocks [0, ceil(R / block_size))
    snapshot: Snapshot | None
    attention_only_len: int  # tokens an attention-only model could reuse here
    lookup_len: int

    @staticmethod
    def none(lookup_len: int = 0) -> Reuse:
        return Reuse(0, (), None, 0, lookup_len)


@dataclass(frozen=True)
class Allocation:
    """What one `allocate` call added for a request."""

    new_block_ids: list[int]
    live_slot: int
    reused_tokens: int = 0


@dataclass
class _RequestCache:
    # Tree nodes for the request's blocks 0..len-1 (reused or committed; the last may be a
    # partial node). Block i of the request's table is node i's device block, except that a
    # partial node's block is the tree's own copy.
    path: list[TreeNode] = field(default_factory=list)
    num_committed_tokens: int = 0
    # The deepest snapshot on this request's path so far (restored or committed).
    snapshot: Snapshot | None = None


class HybridCacheManager:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        num_live_slots: int,
        num_snapshot_slots: int = 0,
        prefix: PrefixCachingConfig | None = None,
        executor: CacheOpExecutor | None = None,
        host_blocks: int = 0,
        host_slots: int = 0,
    ) -> None:
        self.prefix = prefix or PrefixCachingConfig()
        self.executor = executor
        self.tree = PrefixTree(block_size)
        self.blocks = AttentionBlockManager(num_blocks, block_size, self._evict_block)
        self.states = MambaStateManager(num_live_slots, num_snapshot_slots, self._evict_snapshot)
        self.host = (
            HostTier(
                host_blocks,
                host_slots,
                on_drop_block=self._drop_host_block,
                on_drop_snapshot=self._drop_host_snapshot,
            )
            if host_blocks or host_slots
            else None
        )
        self.stats = CacheStats()
        self._requests: dict[str, _RequestCache] = {}
        self._events: list[CacheEvent] = []
        # Host ids a running admission still reads from: never dropped meanwhile.
        self._pinned_host_blocks: set[int] = set()
        self._pinned_host_slots: set[int] = set()

    # ---- sizes --------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def enabled(self) -> bool:
        return self.prefix.enabled

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free ones, cached ones included."""
        return self.blocks.pool.num_free

    @property
    def num_free_slots(self) -> int:
        return self.states.live.num_free

    # ---- 1. snapshot points ---------------------------------------------------------------

    def snapshot_points(self, request: Request) -> list[int]:
        """Sorted absolute positions at which this request's prompt must be snapshotted; the
        scheduler ends a chunk at each. Rebuilt before every scheduling pass (spec 2.3)."""
        config = self.prefix
        if not config.enabled:
            return []
        length = request.num_prompt_tokens
        points: set[int] = set()
        if config.snapshot_interval > 0:
            points.update(range(config.snapshot_interval, length + 1, config.snapshot_interval))
        if config.save_last_snapshot:
            points.add(length)
            stable = request.stable_prompt_len
            if stable is not None and 0 < stable < length:
                points.add(stable)
        points.update(p for p in config.offsets_from_start if 0 < p <= length)
        points.update(length - p for p in config.offsets_from_end if length - p > 0)
        return sorted(points)

    # ---- 2. reuse lookup ------------------------------------------------------------------

    def find_reuse(self, request: Request) -> Reuse:
        """The deepest position R with attention blocks for [0, R) and a snapshot at exactly R,
        R <= len - 1 (the last token is always computed). Side-effect free."""
        lookup = request.token_ids[:-1]
        if not self.prefix.enabled or not request.reuse_prefix:
            return Reuse.none(len(lookup))
        bs, partial = self.block_size, self.prefix.partial_reuse
        match = self.tree.match(lookup, request.cache_salt, partial=partial)
        attention_len = match.matched_len
        path = tuple(b.node for b in match.blocks)
        if not self.prefix.requires_snapshot:
            beyond = match.levels[len(path) :]
            nodes = path + ((beyond[0][0].node,) if beyond else ())
            return Reuse(attention_len, nodes, None, attention_len, len(lookup))
        # Deepest block first; within a block, the usable snapshot of largest coverage among
        # the nodes sharing a prefix with the lookup there (never beyond the fork: coverage
        # <= tokens matched in that node). A deeper block always means a deeper position.
        for index in range(len(match.levels) - 1, -1, -1):
            usable = [
                m
                for m in match.levels[index]
                if m.node.snapshot is not None
                and m.node.snapshot.coverage <= m.num_tokens
                and (partial or m.node.snapshot.coverage == bs)
            ]
            if usable:
                best = max(usable, key=lambda m: m.node.snapshot.coverage)  # type: ignore[union-attr]
                snapshot = best.node.snapshot
                assert snapshot is not None
                return Reuse(
                    snapshot.position,
                    (*path[:index], best.node),
                    snapshot,
                    attention_len,
                    len(lookup),
                )
        return Reuse(0, (), None, attention_len, len(lookup))

    # ---- 3. allocation --------------------------------------------------------------------

    def allocate(
        self, request: Request, num_new_tokens: int, reuse: Reuse | None = None
    ) -> Allocation | None:
        """Room for the request's next `num_new_tokens` tokens: blocks, and a live slot the
        first time. With `reuse` (first scheduling), also take the reused prefix: share its
        blocks, copy the partially used one, restore the snapshot, and move the request's
        cursor to R. All or nothing: None and no change if the pools are short."""
        request_id = request.request_id
        if reuse is not None and reuse.num_tokens > 0:
            return self._allocate_with_reuse(request, num_new_tokens, reuse)
        needs_slot = not self.states.has_slot(request_id)
        if needs_slot and self.states.live.num_free == 0:
            return None
        num_tokens = request.num_computed_tokens + num_new_tokens
        new_ids = self.blocks.allocate(request_id, num_tokens)
        if new_ids is None:
            return None
        if needs_slot:
            self._requests[request_id] = _RequestCache()
            if reuse is not None and self.prefix.enabled:
                self._record_lookup(reuse, request)
        slot = self.states.allocate(request_id) if needs_slot else self.states.live_slot(request_id)
        return Allocation(new_ids, slot)

    def _allocate_with_reuse(
        self, request: Request, num_new_tokens: int, reuse: Reuse
    ) -> Allocation | None:
        pool, bs = self.blocks.pool, self.block_size
        reused = reuse.num_tokens
        num_full = reused // bs
        shared = reuse.nodes[:num_full]
        partially_used = reuse.nodes[num_full] if reused % bs else None
        to_promote = [n for n in shared if n.block_id is None]
        # Blocks to take from the free queue: promoted ones, then [num_full, end) (the first of
        # which is the private copy of a partially used block). Cached blocks we are about to
        # share sit in that queue too, and stop counting as free once shared.
        num_new_blocks = -(-(reused + num_new_tokens) // bs) - num_full
        # The partially used block is held too, until its rows are copied.
        held = [n for n in (*shared, partially_used) if n is not None and n.block_id is not None]
        sharing_free = sum(1 for n in held if pool.blocks[n.block_id].ref_count == 0)
        if (
            len(to_promote) + num_new_blocks > pool.num_free - sharing_free
            or self.states.live.num_free == 0
        ):
            return None

        snapshot = reuse.snapshot
        self._pinned_host_blocks = {
            n.host_block_id for n in reuse.nodes if n.host_block_id is not None
        }
        self._pinned_host_slots = (
            {snapshot.host_slot}
            if snapshot is not None and snapshot.host_slot is not None
            else set()
        )
        try:
            # 1. Hold the reused blocks first: from now on nothing can evict them.
            for node in held:
                pool.acquire(node.block_id)
            # 2. Bring host-resident shared blocks back to the device.
            for node in to_promote:
                (block_id,) = pool.allocate(1) or ()
                self._load_block(node, block_id)
            table = [n.block_id for n in shared]
            new_ids = pool.allocate(num_new_blocks)
            assert new_ids is not None
            # 3. The partially used block: a private copy of its first rows.
            if partially_used is not None:
                self._copy_block_rows(partially_used, new_ids[0], reused % bs)
                if partially_used.block_id is not None and partially_used in held:
                    pool.release([partially_used.block_id])
            self.blocks.append(request.request_id, [*table, *new_ids])  # type: ignore[list-item]
            # 4. The live slot starts as a copy of the snapshot at R.
            live_slot = self.states.allocate(request.request_id)
            if snapshot is not None:
                self._restore(snapshot, live_slot)
        finally:
            self._pinned_host_blocks = set()
            self._pinned_host_slots = set()
        request.num_computed_tokens = reused
        if request.num_preemptions == 0:
            request.num_cached_tokens = reused
        self._requests[request.request_id] = _RequestCache(list(shared), reused, snapshot)
        self._record_lookup(reuse, request)
        return Allocation(new_ids, live_slot, reused)

    def _record_lookup(self, reuse: Reuse, request: Request) -> None:
        stats = self.stats
        stats.lookups += 1
        stats.reused_tokens += reuse.num_tokens
        stats.unreused_tokens += reuse.lookup_len - reuse.num_tokens
        if reuse.num_tokens == 0:
            stats.misses += 1
            return
        stats.hits += 1
        if reuse.num_tokens % self.block_size == 0:
            stats.aligned_hits += 1
        else:
            stats.unaligned_hits += 1
        logger.debug(
            "request %s reuses %d of %d prompt tokens",
            request.request_id,
            reuse.num_tokens,
            request.num_prompt_tokens,
        )

    def allocate_received(
        self, request: Request, block_hashes: list[bytes], num_tokens: int
    ) -> tuple[int, Allocation] | None:
        """Destination for a transferred request (decode side): share the leading full blocks
        this engine already caches (by key), allocate the rest for `num_tokens` tokens and a
        live slot. Returns (number of blocks held already, allocation), or None if short."""
        pool, bs = self.blocks.pool, self.block_size
        held: list[TreeNode] = []
        for node in self.tree.walk(block_hashes, request.cache_salt):
            if node.block_id is None:
                break  # only on the host: cheaper to receive it again
            held.append(node)
        num_new = -(-num_tokens // bs) - len(held)
        held_free = sum(1 for n in held if pool.blocks[n.block_id].ref_count == 0)
        if num_new > pool.num_free - held_free or self.states.live.num_free == 0:
            return None
        for node in held:
            pool.acquire(node.block_id)  # type: ignore[arg-type]
        new_ids = pool.allocate(num_new)
        assert new_ids is not None
        self.blocks.append(request.request_id, [*(n.block_id for n in held), *new_ids])
        slot = self.states.allocate(request.request_id)
        self._requests[request.request_id] = _RequestCache(held, len(held) * bs)
        return len(held), Allocation(new_ids, slot)

    def rename(self, request_id: str, new_id: str) -> None:
        """Move everything `request_id` holds to `new_id` (e.g. a quarantine owner)."""
        self.blocks.rename(request_id, new_id)
        self.states.rename(request_id, new_id)
        if request_id in self._requests:
            self._requests[new_id] = self._requests.pop(request_id)

    def free_owner(self, owner: str) -> None:
        """Release what an owner that is not a request (a quarantine) holds."""
        self.blocks.free(owner)
        self.states.free(owner)
        self._requests.pop(owner, None)

    # ---- 4. commit ------------------------------------------------------------------------

    def commit(self, request: Request) -> None:
        """After a step advanced `request`: if it now sits on one of its snapshot points,
        publish its prompt blocks up to there and a snapshot of its live state (spec 2.4)."""
        if not self.prefix.enabled or request.request_id not in self._requests:
            return
        state = self._requests[request.request_id]
        points = request.expect_snapshot_points or []
        position = request.num_computed_tokens
        limit = (
            min(max(points), request.num_prompt_tokens) if points else (request.num_prompt_tokens)
        )
        end = min(position, limit)
        if position in points and end > state.num_committed_tokens:
            self._commit_range(request, state, end)

    def commit_turn_end(self, request: Request) -> None:
        """A request finished: publish every token the model consumed and the live state
        after them, so the conversation's next turn resumes here.

            token_ids: | prompt ............ | output ......... |
            consumed:  | ................................. | last |   the last sampled
                                                           ^ snapshot   token never ran
        """
        if not (self.prefix.enabled and self.prefix.snapshot_turn_end):
            return
        state = self._requests.get(request.request_id)
        end = request.num_computed_tokens
        if state is not None and end > state.num_committed_tokens:
            self._commit_range(request, state, end)

    def _commit_range(self, request: Request, state: _RequestCache, end: int) -> None:
        bs = self.block_size
        table = self.blocks.block_table(request.request_id)
        if state.path and not state.path[-1].is_full:
            state.path.pop()  # a partial node of an earlier commit: this commit extends it
        parent = state.path[-1] if state.path else self.tree.root(request.cache_salt)
        for index in range(len(state.path), -(-end // bs)):
            tokens = request.token_ids[index * bs : min((index + 1) * bs, end)]
            node = self.tree.child(parent, tokens)
            if node is None:
                node = self._insert(parent, tokens, table[index])
                if node is None:
                    return  # no block for the tree's copy: skip, only reuse is lost
            elif node.is_full:
                self._share_existing(request, node, index)
            state.path.append(node)
            parent = node
        state.num_committed_tokens = end
        if self.prefix.requires_snapshot:
            self._save_snapshot(parent, end - parent.start, request, state)

    def _insert(self, parent: TreeNode, tokens: list[int], own_block: int) -> TreeNode | None:
        """Register a block of a request in the tree. A full block is shared as it is (the
        request never writes it again); a partial one gets a copy, since the request keeps
        writing its own."""
        pool = self.blocks.pool
        node = self.tree.insert(parent, tokens)
        if node.is_full:
            assert pool.blocks[own_block].node is None
            node.block_id = own_block
            pool.blocks[own_block].node = node
        else:
            copy = pool.allocate(1)
            if copy is None:
                self.tree.detach(node)
                return None
            self._executor().copy_block(own_block, copy[0], len(tokens))
            node.block_id = copy[0]
            pool.blocks[copy[0]].node = node
            pool.release(copy)  # owned by the tree alone: cached and evictable
        self._events.append(BlockStored(node.key, parent.key, len(tokens)))
        # A longer block replaces shorter partial siblings, adopting their snapshot when it has
        # none or a shorter one (registered first, then the sibling goes: spec 2.2).
        for sibling in self.tree.shorter_siblings(node):
            adopted = sibling.snapshot
            if adopted is not None and (
                node.snapshot is None or node.snapshot.coverage < adopted.coverage
            ):
                if node.snapshot is not None:
                    self._drop_snapshot(node.snapshot)
                sibling.snapshot, node.snapshot, adopted.node = None, adopted, node
                self._events.append(SnapshotRemoved(sibling.key, adopted.coverage))
                self._events.append(_snapshot_stored(node, adopted.coverage))
            self._remove_subtree(sibling)
        return node

    def _share_existing(self, request: Request, node: TreeNode, index: int) -> None:
        """Another request already published this full block: use the tree's copy from now on
        (same tokens, so the same K/V), which keeps every path node held by its requests."""
        pool = self.blocks.pool
        table = self.blocks.block_table(request.request_id)
        own = table[index]
        if node.block_id is None:  # only on the host: our block becomes its device copy
            assert pool.blocks[own].node is None
            node.block_id = own
            pool.blocks[own].node = node
        elif node.block_id != own:
            pool.acquire(node.block_id)
            table[index] = node.block_id
            pool.release([own])

    def _save_snapshot(
        self, node: TreeNode, coverage: int, request: Request, state: _RequestCache
    ) -> None:
        existing = node.snapshot
        if existing is not None and existing.coverage >= coverage:
            if existing.coverage == coverage and existing.slot is not None:
                self.states.snapshots.touch(existing)
            return
        slot = self.states.snapshots.allocate()
        if slot is None:
            return  # no snapshot capacity at all: reuse is lost, correctness is not
        self._executor().copy_slot(self.states.live_slot(request.request_id), slot)
        if node.snapshot is not None:  # re-read: the allocation may have evicted it
            self._drop_snapshot(node.snapshot)
        snapshot = Snapshot(node, coverage)
        self.states.snapshots.attach(snapshot, slot)
        node.snapshot = snapshot
        self._events.append(_snapshot_stored(node, coverage))
        # NOTE: a deeper snapshot on the same path supersedes the request's previous one for
        # anything that continues this sequence (the next turn of a conversation); only a
        # fork between the two still needs it, so it becomes the first to evict (a no-op if it
        # has no device slot any more).
        if state.snapshot is not None:
            self.states.snapshots.demote(state.snapshot)
        state.snapshot = snapshot

    # ---- release --------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        return self.blocks.block_table(request_id)

    def live_slot(self, request_id: str) -> int:
        return self.states.live_slot(request_id)

    def free(self, request: Request) -> None:
        """Release everything the request holds; its committed blocks stay cached."""
        self.blocks.free(request.request_id)
        self.states.free(request.request_id)
        self._requests.pop(request.request_id, None)

    def clear(self) -> None:
        """Drop every cached block and snapshot (requests keep their private blocks)."""
        for root in list(self.tree.roots.values()):
            for child in list(root.children.values()):
                self._remove_subtree(child)

    def take_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    # ---- eviction and tiers ---------------------------------------------------------------

    def _executor(self) -> CacheOpExecutor:
        assert self.executor is not None, "prefix caching needs an executor to move data"
        return self.executor

    def _evict_block(self, block: Block) -> None:
        """The pool hands out a cached block: keep its node on the host, or drop the node."""
        node = block.node
        assert node is not None
        block.node, node.block_id = None, None
        # NOTE: a node can already have a host copy (`_share_existing` gave a host-only node
        # a device copy again); that copy stays valid, and a second one would leak.
        if self.host is not None and node.host_block_id is None:
            host_id = self.host.blocks.allocate(node, pinned=self._pinned_host_blocks)
            if host_id is not None:
                self._executor().offload_block(block.block_id, host_id)
                node.host_block_id = host_id
                return
        if node.host_block_id is None:
            self._remove_subtree(node)

    def _evict_snapshot(self, snapshot: Snapshot) -> None:
        """The snapshot pool needs this snapshot's device slot."""
        slot = snapshot.slot
        assert slot is not None
        snapshot.slot = None
        if self.host is not None and snapshot.host_slot is None:
            host_slot = self.host.slots.allocate(snapshot, pinned=self._pinned_host_slots)
            if host_slot is not None:
                self._executor().offload_slot(slot, host_slot)
                snapshot.host_slot = host_slot
        if snapshot.host_slot is None:
            self._detach_snapshot(snapshot)

    def _drop_host_block(self, node: TreeNode) -> None:
        node.host_block_id = None
        if node.block_id is None:
            self._remove_subtree(node)

    def _drop_host_snapshot(self, snapshot: Snapshot) -> None:
        snapshot.host_slot = None
        if snapshot.slot is None:
            self._detach_snapshot(snapshot)

    def _load_block(self, node: TreeNode, block_id: int) -> None:
        """Promote a host-resident node: `block_id` (held by the caller) becomes its copy."""
        assert self.host is not None and node.host_block_id is not None
        self._executor().load_block(node.host_block_id, block_id)
        self.host.blocks.free(node.host_block_id)
        node.host_block_id, node.block_id = None, block_id
        self.blocks.pool.blocks[block_id].node = node

    def _copy_block_rows(self, node: TreeNode, dst: int, num_tokens: int) -> None:
        if node.block_id is not None:
            self._executor().copy_block(node.block_id, dst, num_tokens)
        else:
            assert self.host is not None and node.host_block_id is not None
            self._executor().load_block(node.host_block_id, dst)
            self.host.blocks.touch(node.host_block_id)

    def _restore(self, snapshot: Snapshot, live_slot: int) -> None:
        """Copy the snapshot into the live slot; promote it to the device if it was evicted."""
        if snapshot.slot is not None:
            self._executor().copy_slot(snapshot.slot, live_slot)
            self.states.snapshots.touch(snapshot)
            return
        assert self.host is not None and snapshot.host_slot is not None
        self._executor().load_slot(snapshot.host_slot, live_slot)
        slot = self.states.snapshots.allocate()
        if slot is not None:
            self._executor().copy_slot(live_slot, slot)
            self.host.slots.free(snapshot.host_slot)
            snapshot.host_slot = None
            self.states.snapshots.attach(snapshot, slot)

    def _drop_snapshot(self, snapshot: Snapshot) -> None:
        if snapshot.slot is not None:
            self.states.snapshots.release(snapshot)
        if snapshot.host_slot is not None:
            assert self.host is not None
            self.host.slots.free(snapshot.host_slot)
            snapshot.host_slot = None
        self._detach_snapshot(snapshot)

    def _detach_snapshot(self, snapshot: Snapshot) -> None:
        if snapshot.node.snapshot is snapshot:
            snapshot.node.snapshot = None
            self._events.append(SnapshotRemoved(snapshot.node.key, snapshot.coverage))

    def _remove_subtree(self, node: TreeNode) -> None:
        """Take `node` and its descendants out of the tree, releasing their pages. No running
        request holds any of them (a request holds every node on its path from the root)."""
        pool = self.blocks.pool
        for member in node.subtree():
            if member.block_id is not None:
                block = pool.blocks[member.block_id]
                assert block.ref_count == 0, "evicting a block a request still holds"
                block.node, member.block_id = None, None
            if member.host_block_id is not None:
                assert self.host is not None
                self.host.blocks.free(member.host_block_id)
                member.host_block_id = None
            if member.snapshot is not None:
                self._drop_snapshot(member.snapshot)
            self._events.append(BlockRemoved(member.key))
        self.tree.detach(node)

    # ---- checks ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Recount every pool against its owners and the tree against its pages."""
        self.blocks.check_integrity()
        self.states.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        pool = self.blocks.pool
        problems = []
        tree_blocks = set()
        for node in self.tree.nodes():
            if node.block_id is None and node.host_block_id is None:
                problems.append(f"node at block {node.ordinal} has no page")
            if node.block_id is not None:
                tree_blocks.add(node.block_id)
                if pool.blocks[node.block_id].node is not node:
                    problems.append(f"block {node.block_id} does not point back to its node")
            snapshot = node.snapshot
            if snapshot is not None and (
                snapshot.node is not node
                or (snapshot.slot is None and snapshot.host_slot is None)
                or not 0 < snapshot.coverage <= node.num_tokens
            ):
                problems.append(f"bad snapshot on node at block {node.ordinal}")
        cached = {b.block_id for b in pool.blocks if b.node is not None}
        if cached != tree_blocks:
            problems.append(f"{len(cached ^ tree_blocks)} blocks cached outside the tree")
        for request_id, state in self._requests.items():
            table = self.blocks.block_table(request_id)
            for index, node in enumerate(state.path):
                if node.is_full and node.block_id != table[index]:
                    problems.append(f"request {request_id} block {index} is not its path node's")
        if problems:
            raise RuntimeError("prefix cache integrity check failed: " + "; ".join(problems[:5]))


def _snapshot_stored(node: TreeNode, coverage: int) -> SnapshotStored:
    if coverage == node.num_tokens:
        return SnapshotStored(node.key, coverage)
    assert node.parent is not None
    return SnapshotStored(
        node.key, coverage, block_hash(node.parent.key, node.token_ids[:coverage])
    )
