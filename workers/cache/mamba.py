"""MambaStateManager: live slots for running requests and a pool of snapshot slots.

The Mamba state tensors have `num_live_slots + num_snapshot_slots` slots:

    slot:  0 ........ num_live_slots-1 | num_live_slots ........ total-1
           live (one per running request,  snapshots (owned by prefix-tree nodes,
           handed out lowest first)        evicted least recently used first)

Keeping the two apart keeps live slots packed at the low end (decode rows then cover one
contiguous run) and makes "enough slots for every running request" a fixed fact.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from hybridserve.workers.cache.id_pool import IdPool
from hybridserve.workers.cache.prefix_tree import Snapshot


class SnapshotPool:
    def __init__(
        self, first_slot: int, num_slots: int, on_evict: Callable[[Snapshot], None]
    ) -> None:
        self.first_slot = first_slot
        self.ids = IdPool("Mamba snapshot slots", num_slots)
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


class MambaStateManager:
    def __init__(
        self, num_live_slots: int, num_snapshot_slots: int, on_evict: Callable[[Snapshot], None]
    ) -> None:
        self.num_live_slots = num_live_slots
        self.live = IdPool("Mamba live slots", num_live_slots, order="lowest")
        self.snapshots = SnapshotPool(num_live_slots, num_snapshot_slots, on_evict)
        self._live: dict[str, int] = {}

    @property
    def num_slots(self) -> int:
        return self.num_live_slots + self.snapshots.ids.size

    def has_slot(self, request_id: str) -> bool:
        return request_id in self._live

    def allocate(self, request_id: str) -> int:
        """A live slot. Its contents are garbage until the request's first chunk (which starts
        from the zero state) or a snapshot restore writes it."""
        assert request_id not in self._live, f"{request_id} already has a live slot"
        (slot,) = self.live.allocate(1)
        self._live[request_id] = slot
        return slot

    def rename(self, request_id: str, new_id: str) -> None:
        self._live[new_id] = self._live.pop(request_id)

    def live_slot(self, request_id: str) -> int:
        return self._live[request_id]

    def free(self, request_id: str) -> None:
        slot = self._live.pop(request_id, None)
        if slot is not None:
            self.live.free([slot])

    def check_integrity(self) -> None:
        self.live.check_integrity(list(self._live.values()))
        self.snapshots.check_integrity()
