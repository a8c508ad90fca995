"""CacheCoordinator: all-or-nothing allocation, block-table growth, freeing, integrity."""

from __future__ import annotations

import pytest

from tests.helpers import make_cache, make_request


def counts(cache):
    return cache.num_free_blocks, cache.num_free_slots


def test_first_allocation_takes_a_slot_and_the_blocks_for_the_chunk():
    cache = make_cache(num_blocks=8, block_size=4, num_slots=2)
    a = make_request("a", 10)
    allocation = cache.allocate(a, 10)
    assert allocation is not None
    assert allocation.new_block_ids == [0, 1, 2]
    assert allocation.live_slot == 0
    assert cache.block_table("a") == [0, 1, 2]
    assert cache.live_slot("a") == 0
    assert counts(cache) == (5, 1)
    cache.check_integrity()


@pytest.mark.parametrize(
    ("num_tokens", "num_blocks"), [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (16, 4)]
)
def test_block_table_holds_exactly_ceil_tokens_over_block_size(num_tokens, num_blocks):
    cache = make_cache(num_blocks=4, block_size=4)
    request = make_request("a", num_tokens)
    allocation = cache.allocate(request, num_tokens)
    assert allocation is not None
    assert allocation.new_block_ids == list(range(num_blocks))
    assert cache.num_free_blocks == 4 - num_blocks
    cache.check_integrity()


def test_block_table_grows_only_when_a_chunk_crosses_a_block_boundary():
    cache = make_cache(num_blocks=6, block_size=4, num_slots=2)
    a = make_request("a", 12)
    assert cache.allocate(a, 5).new_block_ids == [0, 1]
    a.num_computed_tokens = 5
    # Tokens 5..7 still fit in block 1: nothing new, same slot.
    allocation = cache.allocate(a, 3)
    assert allocation.new_block_ids == []
    assert allocation.live_slot == 0
    a.num_computed_tokens = 8
    assert cache.allocate(a, 1).new_block_ids == [2]
    a.num_computed_tokens = 9
    assert cache.allocate(a, 3).new_block_ids == []
    assert cache.block_table("a") == [0, 1, 2]
    assert counts(cache) == (3, 1)
    cache.check_integrity()


def test_two_requests_get_disjoint_blocks_and_slots():
    cache = make_cache(num_blocks=6, block_size=4, num_slots=3)
    a, b = make_request("a", 6), make_request("b", 9)
    assert cache.allocate(a, 6).new_block_ids == [0, 1]
    allocation = cache.allocate(b, 9)
    assert allocation.new_block_ids == [2, 3, 4]
    assert allocation.live_slot == 1
    assert counts(cache) == (1, 1)
    cache.check_integrity()


def test_too_few_blocks_returns_none_and_changes_nothing():
    cache = make_cache(num_blocks=3, block_size=4, num_slots=2)
    a, b = make_request("a", 8), make_request("b", 8)
    cache.allocate(a, 8)
    before = counts(cache)
    assert before == (1, 1)
    assert cache.allocate(b, 8) is None  # needs 2 blocks, 1 free
    assert counts(cache) == before
    assert not cache.recurrent.has_slot("b")  # no slot was taken for the failed request
    with pytest.raises(KeyError):
        cache.block_table("b")
    # A running request that cannot grow keeps what it had.
    a.num_computed_tokens = 8
    assert cache.allocate(a, 5) is None  # needs 2 more blocks
    assert cache.block_table("a") == [0, 1]
    assert counts(cache) == before
    cache.check_integrity()
    # What does fit still works afterwards.
    assert cache.allocate(b, 4).new_block_ids == [2]


def test_no_free_slot_returns_none_and_changes_nothing():
    cache = make_cache(num_blocks=8, block_size=4, num_slots=1)
    a, b = make_request("a", 4), make_request("b", 4)
    cache.allocate(a, 4)
    assert counts(cache) == (7, 0)
    assert cache.allocate(b, 4) is None
    assert counts(cache) == (7, 0)
    assert not cache.recurrent.has_slot("b")
    cache.check_integrity()
    # The slot holder itself can still grow: it needs no new slot.
    a.num_computed_tokens = 4
    assert cache.allocate(a, 1).new_block_ids == [1]


def test_free_returns_every_block_and_the_slot():
    cache = make_cache(num_blocks=8, block_size=4, num_slots=2)
    a, b = make_request("a", 13), make_request("b", 5)
    cache.allocate(a, 13)
    cache.allocate(b, 5)
    assert counts(cache) == (2, 0)
    cache.free(a)
    assert counts(cache) == (6, 1)
    cache.check_integrity()
    cache.free(b)
    assert counts(cache) == (8, 2)
    cache.check_integrity()
    # Freeing a request that holds nothing (e.g. aborted while waiting) is a no-op.
    cache.free(make_request("never-allocated", 3))
    assert counts(cache) == (8, 2)
    # KV blocks are reused oldest-freed first; slots lowest first.
    c = make_request("c", 8)
    allocation = cache.allocate(c, 8)
    assert allocation.new_block_ids == [6, 7]
    assert allocation.live_slot == 0
    cache.check_integrity()


def test_check_integrity_catches_a_block_in_two_tables():
    cache = make_cache(num_blocks=4, block_size=4)
    cache.allocate(make_request("a", 8), 8)
    cache.attention._tables["ghost"] = [cache.block_table("a")[1]]
    with pytest.raises(RuntimeError) as info:
        cache.check_integrity()
    held = cache.block_table("a")[1]
    assert "KV block pool integrity check failed (4 total, 2 free)" in str(info.value)
    assert f"block {held}: ref_count 1, 2 holders" in str(info.value)


def test_check_integrity_catches_a_leaked_slot():
    cache = make_cache(num_blocks=4, block_size=4, num_slots=3)
    cache.allocate(make_request("a", 4), 4)
    del cache.recurrent._live["a"]  # the slot is lost to everyone
    with pytest.raises(RuntimeError) as info:
        cache.check_integrity()
    assert str(info.value) == (
        "state live slots integrity check failed (3 total, 2 free, 0 held): 1 ids leaked"
    )
