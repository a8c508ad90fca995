"""IdPool: reuse order, misuse asserts, and what check_integrity catches."""

from __future__ import annotations

import pytest

from hybridserve.workers.cache.id_pool import IdPool


def test_fifo_reuses_the_id_freed_longest_ago():
    pool = IdPool("KV block pool", 5)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([2, 0])
    assert pool.num_free == 4
    assert pool.allocate(3) == [3, 4, 2]
    assert pool.allocate(1) == [0]
    assert pool.num_free == 0
    pool.check_integrity([0, 1, 2, 3, 4])


def test_lowest_reuses_the_smallest_free_id():
    pool = IdPool("Mamba slot pool", 5, order="lowest")
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([2, 0])
    assert pool.allocate(1) == [0]
    pool.free([1])
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(1) == [4]
    pool.check_integrity([0, 1, 2, 3, 4])


@pytest.mark.parametrize("order", ["fifo", "lowest"])
def test_allocate_zero_and_free_nothing_change_nothing(order):
    pool = IdPool("pool", 3, order=order)
    assert pool.allocate(0) == []
    pool.free([])
    assert pool.num_free == 3
    pool.check_integrity([])


@pytest.mark.parametrize("order", ["fifo", "lowest"])
def test_double_free_asserts(order):
    pool = IdPool("KV block pool", 4, order=order)
    ids = pool.allocate(2)
    pool.free([ids[0]])
    with pytest.raises(AssertionError, match=f"KV block pool: id {ids[0]} freed twice"):
        pool.free([ids[0]])
    with pytest.raises(AssertionError, match="id 3 freed twice"):
        pool.free([3])  # never allocated


def test_allocating_more_than_free_asserts():
    pool = IdPool("KV block pool", 4)
    pool.allocate(3)
    with pytest.raises(AssertionError, match="KV block pool: 2 wanted, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_check_integrity_passes_when_every_id_is_free_or_held_once():
    pool = IdPool("KV block pool", 6)
    held = pool.allocate(4)
    pool.free(held[1:3])
    pool.check_integrity([held[0], held[3]])


def test_check_integrity_catches_a_leak():
    pool = IdPool("KV block pool", 4)
    ids = pool.allocate(2)
    # Id ids[1] is allocated but nobody holds it: it can never come back.
    with pytest.raises(RuntimeError) as info:
        pool.check_integrity([ids[0]])
    assert str(info.value) == (
        "KV block pool integrity check failed (4 total, 2 free, 1 held): 1 ids leaked"
    )


def test_check_integrity_catches_a_double_hold():
    pool = IdPool("KV block pool", 4)
    a, b = pool.allocate(2)
    with pytest.raises(RuntimeError) as info:
        pool.check_integrity([a, a, b])
    assert str(info.value) == (
        "KV block pool integrity check failed (4 total, 2 free, 3 held): 1 ids held twice"
    )


def test_check_integrity_catches_an_id_both_free_and_held():
    pool = IdPool("Mamba slot pool", 3, order="lowest")
    (slot,) = pool.allocate(1)
    pool.free([slot])
    with pytest.raises(RuntimeError) as info:
        pool.check_integrity([slot])  # an owner kept a slot it gave back
    assert str(info.value).endswith("(3 total, 3 free, 1 held): 1 ids both free and held")
    assert str(info.value).startswith("Mamba slot pool integrity check failed")


def test_check_integrity_catches_a_corrupt_free_queue():
    pool = IdPool("KV block pool", 3)
    pool._free.append(0)  # the same id queued twice: it would be handed out twice
    with pytest.raises(RuntimeError, match=r"\(3 total, 4 free, 0 held\): duplicate ids"):
        pool.check_integrity([])


def test_check_integrity_catches_flags_that_disagree_with_the_queue():
    pool = IdPool("KV block pool", 3)
    pool._is_free[1] = False  # a flag says allocated, the queue says free
    with pytest.raises(RuntimeError, match="free flags disagree with the free queue"):
        pool.check_integrity([])
