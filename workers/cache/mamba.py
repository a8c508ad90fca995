"""MambaStateManager: each running request's live slot in the Mamba state pool."""

from __future__ import annotations

from hybridserve.workers.cache.id_pool import IdPool


class MambaStateManager:
    def __init__(self, num_slots: int) -> None:
        self.pool = IdPool("Mamba slot pool", num_slots, order="lowest")
        self._live: dict[str, int] = {}

    def has_slot(self, request_id: str) -> bool:
        return request_id in self._live

    def allocate(self, request_id: str) -> int:
        """A live slot for the request. Its contents are garbage: the first chunk of a request
        starts from the zero state (the runner passes no initial slot), never from the slot."""
        assert request_id not in self._live, f"{request_id} already has a live slot"
        (slot,) = self.pool.allocate(1)
        self._live[request_id] = slot
        return slot

    def live_slot(self, request_id: str) -> int:
        return self._live[request_id]

    def free(self, request_id: str) -> None:
        slot = self._live.pop(request_id, None)
        if slot is not None:
            self.pool.free([slot])

    def check_integrity(self) -> None:
        self.pool.check_integrity(list(self._live.values()))
