"""EngineLoads picks what scoring every engine would pick: highest reuse minus load, ties to
the first engine at or after the turn's, in slot order. Oracle: that rule applied to every
engine one by one, over random loads, reuse groups, turns, and engines leaving and joining."""

from __future__ import annotations

import random

import pytest

from hybridserve.cluster.routing.engine_loads import EngineLoads


def every_engine(
    load: dict[int, int], groups: list[tuple[int, int]], turn: int, cost: int
) -> tuple[int, int]:
    """(slot, reuse) of the winner, scoring each engine alone."""
    order = sorted(load)
    reuse = {slot: tokens for mask, tokens in groups for slot in order if mask >> slot & 1}
    start = turn % len(order)
    best = max(
        order,
        key=lambda s: (reuse.get(s, 0) - cost * load[s], -((order.index(s) - start) % len(order))),
    )
    return best, reuse.get(best, 0)


def test_the_module_s_example():
    loads = EngineLoads()
    for slot, load in enumerate([1, 0, 2, 0, 1, 0]):
        loads.add(f"e{slot}", slot)
        for _ in range(load):
            loads.change(f"e{slot}", +1)
    assert loads.best([(0b10010, 200)], 3, 128) == ("e1", 200)
    assert loads.best([], 3, 128) == ("e3", 0)  # least loaded, first at or after the turn
    assert loads.best([], 4, 128) == ("e5", 0)
    assert loads.best([(1 << 2, 200)], 3, 128) == ("e3", 0)  # 200 - 2 * 128 < 0
    assert loads.best([(1 << 0, 128)], 0, 128) == ("e0", 128)  # a tie, e0 at the turn
    assert loads.total == 4 and loads.at(7) == "e1"


@pytest.mark.parametrize("cost", [0, 1, 128])
def test_random_loads_pick_what_scoring_every_engine_picks(cost):
    rng = random.Random(cost)
    loads, load = EngineLoads(), {}
    for _ in range(20_000):
        roll = rng.random()
        if roll < 0.02 or not load:
            slot = rng.randrange(40)
            if slot in load:
                loads.remove(f"e{slot}")
                del load[slot]
            else:
                loads.add(f"e{slot}", slot)
                load[slot] = 0
            continue
        slot = rng.choice(list(load))
        if roll < 0.5:
            loads.change(f"e{slot}", +1)
            load[slot] += 1
        elif roll < 0.8:
            loads.change(f"e{slot}", -1)
            load[slot] = max(0, load[slot] - 1)
        else:
            members = rng.sample(range(48), rng.randint(0, 12))  # some not engines here
            groups = []
            for size in (3, 3, 6):
                chosen, members = members[:size], members[size:]
                groups.append((sum(1 << s for s in chosen), rng.choice([0, 1, 64, 128, 256])))
            turn = rng.randrange(1000)
            expected = every_engine(load, groups, turn, cost)
            assert loads.best(groups, turn, cost) == (f"e{expected[0]}", expected[1])
        assert loads.loads() == {f"e{s}": n for s, n in load.items()}
        assert loads.names == [f"e{s}" for s in sorted(load)]
        assert loads.total == sum(load.values())
