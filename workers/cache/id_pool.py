"""A fixed set of integer ids (KV blocks or state slots) handed out and returned."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from typing import Literal


class IdPool:
    """Ids 0..size-1. Order "fifo": the id freed longest ago is reused first. Order "lowest":
    the smallest free id first, which keeps live ids packed at the low end (state slots: decode
    rows then cover one contiguous run of the state pool)."""

    def __init__(self, name: str, size: int, order: Literal["fifo", "lowest"] = "fifo") -> None:
        self.name = name
        self.size = size
        self.order = order
        self._free: deque[int] | list[int] = (
            deque(range(size)) if order == "fifo" else list(range(size))
        )  # a sorted list is a valid heap
        self._is_free = [True] * size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` ids; the caller checks `num_free` first."""
        assert count <= len(self._free), f"{self.name}: {count} wanted, {len(self._free)} free"
        if isinstance(self._free, deque):
            ids = [self._free.popleft() for _ in range(count)]
        else:
            ids = [heapq.heappop(self._free) for _ in range(count)]
        for i in ids:
            self._is_free[i] = False
        return ids

    def free(self, ids: Iterable[int]) -> None:
        for i in ids:
            assert not self._is_free[i], f"{self.name}: id {i} freed twice"
            self._is_free[i] = True
            if isinstance(self._free, deque):
                self._free.append(i)
            else:
                heapq.heappush(self._free, i)

    def check_integrity(self, held: list[int]) -> None:
        """Every id is either free or held by exactly one owner; raise with the counts if not."""
        problems = []
        if len(set(held)) != len(held):
            problems.append(f"{len(held) - len(set(held))} ids held twice")
        if len(set(self._free)) != len(self._free):
            problems.append("duplicate ids in the free queue")
        free_set = set(self._free)
        if free_set & set(held):
            problems.append(f"{len(free_set & set(held))} ids both free and held")
        if len(free_set | set(held)) != self.size:
            problems.append(f"{self.size - len(free_set | set(held))} ids leaked")
        if any(self._is_free[i] != (i in free_set) for i in range(self.size)):
            problems.append("free flags disagree with the free queue")
        if problems:
            raise RuntimeError(
                f"{self.name} integrity check failed ({self.size} total, "
                f"{len(self._free)} free, {len(held)} held): {'; '.join(problems)}"
            )
