"""The engines of one role, with the requests in flight on each, and the choice among them:
highest reuse minus load, ties going round the engines.

An engine's score is `reuse - load_cost_tokens * load`. Engines are ordered by their slot in
the prefix index (`PrefixIndex.add_engine`), and among equal scores the first engine at or
after the turn's (the turn-th engine in that order, cyclically) wins, so ties rotate.

The index answers a prompt with groups of engines that could reuse the same number of tokens
(bit masks over slots, `Reuse`), and the engines are grouped here by load (a mask per load),
so a choice never visits engines one by one: in each reuse group, the best engine is the first
at or after the turn among its least loaded members (two masks ANDed, one bit found), and the
best of all the other engines is the first at or after the turn among the least loaded of all
(should that one be in a group, it only scores higher). A choice costs O(groups x distinct
loads) operations on masks, whatever the number of engines:

    slots:    0  1  2  3  4  5      turn 3 (start at slot 3), cost 128, groups [({1, 4}, 200)]
    load:     1  0  2  0  1  0      group: least loaded member 1 (load 0): 200 - 0 = 200
                                    others: load 0 -> {1, 3, 5}, first at/after 3: 3, score 0
                                    engine 1 wins
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def _first_from(mask: int, start: int) -> int:
    """The lowest set bit at or after `start`, else the lowest set bit (mask > 0)."""
    above = mask >> start
    if above:
        return start + (above & -above).bit_length() - 1
    return (mask & -mask).bit_length() - 1


class EngineLoads:
    def __init__(self) -> None:
        self._slots: list[int] = []  # sorted: the routing order
        self._slot: dict[str, int] = {}
        self._name: dict[int, str] = {}
        self._load: dict[int, int] = {}
        self._by_load: dict[int, int] = {}  # load -> mask of the slots with that load
        self.members = 0  # mask of the slots
        self.total = 0  # requests in flight on all of them

    @property
    def names(self) -> list[str]:
        return [self._name[slot] for slot in self._slots]

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, name: object) -> bool:
        return name in self._slot

    def loads(self) -> dict[str, int]:
        return {self._name[slot]: load for slot, load in self._load.items()}

    def at(self, turn: int) -> str:
        """The turn-th engine in routing order, cyclically."""
        return self._name[self._slots[turn % len(self._slots)]]

    def add(self, name: str, slot: int) -> None:
        """An engine with nothing in flight, at its index slot."""
        bisect.insort(self._slots, slot)
        self._slot[name], self._name[slot] = slot, name
        self._load[slot] = 0
        self._by_load[0] = self._by_load.get(0, 0) | 1 << slot
        self.members |= 1 << slot

    def remove(self, name: str) -> None:
        slot = self._slot.pop(name, None)
        if slot is None:
            return
        self._slots.remove(slot)
        del self._name[slot]
        load = self._load.pop(slot)
        self.total -= load
        self._leave(load, slot)
        self.members &= ~(1 << slot)

    def _leave(self, load: int, slot: int) -> None:
        remaining = self._by_load[load] & ~(1 << slot)
        if remaining:
            self._by_load[load] = remaining
        else:
            del self._by_load[load]

    def change(self, name: str, step: int) -> None:
        """One more (+1) or one fewer (-1) request in flight on `name`; never below zero."""
        slot = self._slot.get(name)
        if slot is None or self._load[slot] + step < 0:
            return
        load = self._load[slot]
        self._leave(load, slot)
        self._by_load[load + step] = self._by_load.get(load + step, 0) | 1 << slot
        self._load[slot] = load + step
        self.total += step

    def best(self, groups: Iterable[tuple[int, int]], turn: int, cost: int) -> tuple[str, int]:
        """The engine with the highest `reuse - cost * load`, ties to the first at or after
        the turn, and its reuse. `groups`: (slot mask, reuse tokens), each engine in at most
        one; engines in none reuse nothing."""
        count = len(self._slots)
        start = self._slots[turn % count]
        loads = sorted(self._by_load)
        best: tuple[int, int] | None = None  # (score, -distance from the turn's engine)
        winner, won = -1, 0
        for engines, tokens in groups:
            engines &= self.members
            if not engines or tokens <= 0:
                continue
            slot, load = self._least_loaded(engines, start, loads, cost)
            key = (tokens - cost * load, -self._distance(slot, turn))
            if best is None or key > best:
                best, winner, won = key, slot, tokens
        slot, load = self._least_loaded(self.members, start, loads, cost)
        key = (-cost * load, -self._distance(slot, turn))
        if best is None or key > best:
            winner, won = slot, 0
        return self._name[winner], won

    def _least_loaded(
        self, engines: int, start: int, loads: list[int], cost: int
    ) -> tuple[int, int]:
        """The first of `engines` at or after `start` among their least loaded (among all of
        them when load costs nothing), and its load."""
        if cost == 0:
            slot = _first_from(engines, start)
            return slot, self._load[slot]
        for load in loads:
            among = engines & self._by_load[load]
            if among:
                return _first_from(among, start), load
        raise AssertionError("an engine without a load")

    def _distance(self, slot: int, turn: int) -> int:
        """How far after the turn's engine `slot` comes, in routing order."""
        count = len(self._slots)
        return (bisect.bisect_left(self._slots, slot) - turn) % count
