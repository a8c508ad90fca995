"""RecurrentStateManager: live slots for running requests, checkpoint slots for speculative
decoding, and snapshot slots for the prefix tree.

The recurrent state pools have `num_live_slots + num_checkpoint_slots + num_snapshot_slots`
slots:

    slot:  0 ...... live-1 | live ...... live+checkpoints-1 | ............ total-1
           live (one per    checkpoints (a request's state     snapshots (owned by
           running request, before its verify step; none       prefix-tree nodes, evicted
           lowest first)    without speculative decoding)      least recently used first)

Keeping them apart keeps live slots packed at the low end (decode rows then cover one
contiguous run) and makes "enough slots for every running request" a fixed fact.

A state cannot be rewound, so a request about to verify draft tokens keeps a copy of its
live state (`checkpoint`); if a draft is rejected, the copy goes back (`rollback`) and the
accepted tokens are computed again from it. Only states after verified tokens ever reach a
snapshot: a commit reads the live slot, which holds one only between steps.

What a slot holds (a Mamba2 layer's conv window and SSM state, a Gated DeltaNet layer's conv
window and key x value state, for every recurrent layer) is the model runner's business
(models/recurrent_state.py); here a slot is an id.

Reuse rule for recurrent state: a snapshot is the state after exactly `position` tokens, so
only exact snapshot positions are reusable, never "anywhere inside a block". The deepest
snapshot on the matched path wins; a snapshot past the point where the lookup leaves the tree is
never used (it holds tokens the new request does not have).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hybridserve.workers.cache.events import SnapshotRemoved, SnapshotStored
from hybridserve.workers.cache.hashing import block_hash
from hybridserve.workers.cache.host_tier import HostRegion
from hybridserve.workers.cache.id_pool import IdPool
from hybridserve.workers.cache.ops import CacheOpLog, CopySlot, LoadSlot, OffloadSlot
from hybridserve.workers.cache.prefix_tree import Match, Snapshot, TreeNode


@dataclass(frozen=True)
class SnapshotHit:
    """The deepest usable snapshot of a lookup: the state after `position` tokens, on `node`
    (the tree node holding token position - 1; a partial sibling of the matched block can be
    the one that carries it)."""

    position: int
    node: TreeNode
    snapshot: Snapshot


class SnapshotPool:
    def __init__(
        self, first_slot: int, num_slots: int, on_evict: Callable[[Snapshot], None]
    ) -> None:
        self.first_slot = first_slot
        self.ids = IdPool("state snapshot slots", num_slots)
        self.on_evict = on_evict
        # Snapshots holding a device slot, least recently used first.
        self._lru: OrderedDict[Snapshot, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        return self.ids.num_free

    def allocate(self) -> int | None:
        """A free slot, evicting the least recently used snapshot if needed; None if the pool
        has no slots at all."""
        if self.ids.num_free == 0:
            if not self._lru:
                return None
            victim, _ = self._lru.popitem(last=False)
            slot = victim.slot
            self.on_evict(victim)
            assert victim.slot is None, "on_evict must take the snapshot off its slot"
            assert slot is not None
            self.ids.free([slot - self.first_slot])
        return self.ids.allocate(1)[0] + self.first_slot

    def attach(self, snapshot: Snapshot, slot: int) -> None:
        snapshot.slot = slot
        self._lru[snapshot] = None

    def touch(self, snapshot: Snapshot) -> None:
        if snapshot in self._lru:
            self._lru.move_to_end(snapshot)

    def demote(self, snapshot: Snapshot) -> None:
        """Make `snapshot` the next to evict (it has been superseded)."""
        if snapshot in self._lru:
            self._lru.move_to_end(snapshot, last=False)

    def release(self, snapshot: Snapshot) -> None:
        """Give the snapshot's device slot back (the snapshot keeps existing only if it has a
        host copy)."""
        assert snapshot.slot is not None
        del self._lru[snapshot]
        self.ids.free([snapshot.slot - self.first_slot])
        snapshot.slot = None

    def check_integrity(self) -> None:
        self.ids.check_integrity(
            [s.slot - self.first_slot for s in self._lru if s.slot is not None]
        )


class RecurrentStateManager:
    def __init__(
        self,
        num_live_slots: int,
        num_snapshot_slots: int,
        ops: CacheOpLog,
        events: list,
        *,
        num_checkpoint_slots: int = 0,
        num_host_slots: int = 0,
    ) -> None:
        self.num_live_slots = num_live_slots
        self.ops = ops
        self.events = events
        self.live = IdPool("state live slots", num_live_slots, order="lowest")
        self.checkpoints = IdPool("state checkpoint slots", num_checkpoint_slots)
        self.snapshots = SnapshotPool(
            num_live_slots + num_checkpoint_slots, num_snapshot_slots, self._evict
        )
        self.host = (
            HostRegion("host state slots", num_host_slots, self._drop_host_copy)
            if num_host_slots
            else None
        )
        self._live: dict[str, int] = {}
        self._checkpoints: dict[str, int] = {}  # request id -> its checkpoint slot
        # The host slot a running restore reads from: never dropped meanwhile.
        self._pinned: set[int] = set()

    @property
    def num_slots(self) -> int:
        return self.num_live_slots + self.checkpoints.size + self.snapshots.ids.size

    # ---- lookup ---------------------------------------------------------------------------

    def longest_hit(self, match: Match, limit: int, *, partial: bool) -> SnapshotHit | None:
        """The deepest snapshot at a position <= `limit` that the lookup can resume from.
        Without `partial`, only snapshots at block boundaries count. Side-effect free."""
        # Deepest block first; within a block, the usable snapshot of largest coverage among
        # the nodes sharing a prefix with the lookup there (never beyond the fork: coverage
        # <= tokens matched in that node). A deeper block always means a deeper position.
        for index in range(len(match.levels) - 1, -1, -1):
            usable = [
                m
                for m in match.levels[index]
                if m.node.snapshot is not None
                and m.node.snapshot.coverage <= m.num_tokens
                and m.node.snapshot.position <= limit
                and (partial or m.node.snapshot.coverage == m.node.block_size)
            ]
            if usable:
                best = max(usable, key=lambda m: m.node.snapshot.coverage)  # type: ignore[union-attr]
                assert best.node.snapshot is not None
                return SnapshotHit(best.node.snapshot.position, best.node, best.node.snapshot)
        return None

    # ---- live slots -----------------------------------------------------------------------

    def can_allocate(self) -> bool:
        return self.live.num_free > 0

    def has_slot(self, request_id: str) -> bool:
        return request_id in self._live

    def allocate(self, request_id: str) -> int:
        """A live slot. Its contents are garbage until the request's first chunk (which starts
        from the zero state) or a snapshot restore writes it."""
        assert request_id not in self._live, f"{request_id} already has a live slot"
        (slot,) = self.live.allocate(1)
        self._live[request_id] = slot
        return slot

    def live_slot(self, request_id: str) -> int:
        return self._live[request_id]

    def rename(self, request_id: str, new_id: str) -> None:
        self._live[new_id] = self._live.pop(request_id)
        if request_id in self._checkpoints:
            self._checkpoints[new_id] = self._checkpoints.pop(request_id)

    def free(self, request_id: str) -> None:
        slot = self._live.pop(request_id, None)
        if slot is not None:
            self.live.free([slot])
        self.release_checkpoint(request_id)

    # ---- checkpoints (speculative decoding) ------------------------------------------------

    def can_checkpoint(self, request_id: str) -> bool:
        return request_id in self._checkpoints or self.checkpoints.num_free > 0

    def checkpoint(self, request_id: str) -> None:
        """Keep a copy of the request's live state (taken before this step's forward)."""
        slot = self._checkpoints.get(request_id)
        if slot is None:
            slot = self.checkpoints.allocate(1)[0] + self.num_live_slots
            self._checkpoints[request_id] = slot
        self.ops.append(CopySlot(self._live[request_id], slot))

    def rollback(self, request_id: str) -> None:
        """Put the checkpoint back into the live slot (applied before the next step's
        forward) and free it."""
        self.ops.append(CopySlot(self._checkpoints[request_id], self._live[request_id]))
        self.release_checkpoint(request_id)

    def release_checkpoint(self, request_id: str) -> None:
        slot = self._checkpoints.pop(request_id, None)
        if slot is not None:
            self.checkpoints.free([slot - self.num_live_slots])

    # ---- snapshots ------------------------------------------------------------------------

    def restore(self, snapshot: Snapshot, live_slot: int) -> None:
        """Copy the snapshot into the live slot; promote it to the device if it was evicted."""
        if snapshot.slot is not None:
            self.ops.append(CopySlot(snapshot.slot, live_slot))
            self.snapshots.touch(snapshot)
            return
        assert self.host is not None and snapshot.host_slot is not None
        self.ops.append(LoadSlot(snapshot.host_slot, live_slot))
        self._pinned = {snapshot.host_slot}
        try:
            slot = self.snapshots.allocate()
        finally:
            self._pinned = set()
        if slot is not None:
            self.ops.append(CopySlot(live_slot, slot))
            self.host.free(snapshot.host_slot)
            snapshot.host_slot = None
            self.snapshots.attach(snapshot, slot)

    def save(self, node: TreeNode, coverage: int, live_slot: int) -> Snapshot | None:
        """Snapshot the live slot as the state after `coverage` tokens of `node`. A node keeps
        one snapshot, the one of largest coverage. Returns the new snapshot; None when the node
        already has one as deep, or there is no room for one (reuse is lost, correctness is
        not)."""
        existing = node.snapshot
        if existing is not None and existing.coverage >= coverage:
            if existing.coverage == coverage and existing.slot is not None:
                self.snapshots.touch(existing)
            return None
        slot = self.snapshots.allocate()
        if slot is None:
            return None
        self.ops.append(CopySlot(live_slot, slot))
        if node.snapshot is not None:  # re-read: the allocation may have evicted it
            self.drop(node.snapshot)
        snapshot = Snapshot(node, coverage)
        self.snapshots.attach(snapshot, slot)
        node.snapshot = snapshot
        self.events.append(snapshot_stored(node, coverage))
        return snapshot

    def adopt(self, sibling: TreeNode, node: TreeNode) -> None:
        """`node` replaces its shorter partial `sibling`: it takes the sibling's snapshot when it
        has none or a shorter one, so the shorter endpoint stays reusable."""
        adopted = sibling.snapshot
        if adopted is None or (
            node.snapshot is not None and node.snapshot.coverage >= adopted.coverage
        ):
            return
        if node.snapshot is not None:
            self.drop(node.snapshot)
        sibling.snapshot, node.snapshot, adopted.node = None, adopted, node
        self.events.append(SnapshotRemoved(sibling.key, adopted.coverage))
        self.events.append(snapshot_stored(node, adopted.coverage))

    def demote(self, snapshot: Snapshot) -> None:
        """A deeper snapshot on the same path supersedes `snapshot` for anything continuing
        this sequence; only a fork between the two still needs it, so it goes first."""
        self.snapshots.demote(snapshot)

    def release_node(self, node: TreeNode) -> None:
        """`node` leaves the tree: its snapshot goes too."""
        if node.snapshot is not None:
            self.drop(node.snapshot)

    def drop(self, snapshot: Snapshot) -> None:
        if snapshot.slot is not None:
            self.snapshots.release(snapshot)
        if snapshot.host_slot is not None:
            assert self.host is not None
            self.host.free(snapshot.host_slot)
            snapshot.host_slot = None
        self._detach(snapshot)

    def _evict(self, snapshot: Snapshot) -> None:
        """The snapshot pool needs this snapshot's device slot."""
        slot = snapshot.slot
        assert slot is not None
        snapshot.slot = None
        if self.host is not None and snapshot.host_slot is None:
            host_slot = self.host.allocate(snapshot, pinned=self._pinned)
            if host_slot is not None:
                self.ops.append(OffloadSlot(slot, host_slot))
                snapshot.host_slot = host_slot
        if snapshot.host_slot is None:
            self._detach(snapshot)

    def _drop_host_copy(self, snapshot: Snapshot) -> None:
        snapshot.host_slot = None
        if snapshot.slot is None:
            self._detach(snapshot)

    def _detach(self, snapshot: Snapshot) -> None:
        if snapshot.node.snapshot is snapshot:
            snapshot.node.snapshot = None
            self.events.append(SnapshotRemoved(snapshot.node.key, snapshot.coverage))

    # ---- checks ---------------------------------------------------------------------------

    def check_integrity(self, tree_nodes: Iterable[TreeNode]) -> list[str]:
        """Recount the slot pools; returns the tree-side problems found."""
        self.live.check_integrity(list(self._live.values()))
        self.checkpoints.check_integrity(
            [slot - self.num_live_slots for slot in self._checkpoints.values()]
        )
        self.snapshots.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        problems = []
        for node in tree_nodes:
            snapshot = node.snapshot
            if snapshot is not None and (
                snapshot.node is not node
                or (snapshot.slot is None and snapshot.host_slot is None)
                or not 0 < snapshot.coverage <= node.num_tokens
            ):
                problems.append(f"bad snapshot on node at block {node.ordinal}")
        return problems


def snapshot_stored(node: TreeNode, coverage: int) -> SnapshotStored:
    """The event of a snapshot after `coverage` tokens of `node`."""
    if coverage == node.num_tokens:
        return SnapshotStored(node.key, coverage)
    assert node.parent is not None
    return SnapshotStored(
        node.key, coverage, block_hash(node.parent.key, node.token_ids[:coverage])
    )
