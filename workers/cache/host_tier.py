"""The host tier: host-memory copies of evicted KV blocks and snapshots, least recently used
first.

When a device pool evicts a cached block or snapshot and its manager has a host region, the
bytes are copied here and the prefix-tree node keeps it (`host_block_id` / `host_slot`). A later
hit copies it back. When a host region itself is full, its least recently used entry is dropped,
and a node left with no copy anywhere leaves the tree.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Generic, TypeVar

from hybridserve.workers.cache.id_pool import IdPool

Item = TypeVar("Item")


class HostRegion(Generic[Item]):
    """Fixed host ids, each holding the copy of one item, LRU-evicted."""

    def __init__(self, name: str, size: int, on_drop: Callable[[Item], None]) -> None:
        self.ids = IdPool(name, size)
        self.on_drop = on_drop
        self._lru: OrderedDict[int, Item] = OrderedDict()

    def allocate(self, item: Item, pinned: Collection[int] = ()) -> int | None:
        """A host id for `item`, dropping the least recently used unpinned entry if full."""
        if self.ids.num_free == 0:
            victim_id = next((i for i in self._lru if i not in pinned), None)
            if victim_id is None:
                return None
            self.on_drop(self._lru.pop(victim_id))
            self.ids.free([victim_id])
        (host_id,) = self.ids.allocate(1)
        self._lru[host_id] = item
        return host_id

    def free(self, host_id: int) -> None:
        del self._lru[host_id]
        self.ids.free([host_id])

    def touch(self, host_id: int) -> None:
        self._lru.move_to_end(host_id)

    def check_integrity(self) -> None:
        self.ids.check_integrity(list(self._lru))
