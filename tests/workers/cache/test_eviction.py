"""Eviction in the device pools (docs/snapshot-reuse.md section 7): which cached blocks and
snapshots go first, and what a commit or an allocation does when the pools are short."""

from __future__ import annotations

import pytest

from hybridserve.workers.cache.events import (
    BlockRemoved,
    BlockStored,
    SnapshotRemoved,
    SnapshotStored,
)
from hybridserve.workers.cache.hashing import root_hash
from tests.helpers import (
    assert_cache_at_baseline,
    make_prefix_cache,
    make_request,
    take_ops,
    tokens,
)
from tests.workers.cache.drive import (
    OTHER,
    admit,
    advance,
    commit_nine,
    key_of,
    reuse_of,
    run,
    small_cache,
)


def test_lru_eviction_drops_the_deepest_cached_block_first():
    cache = small_cache()
    commit_nine(cache)
    k0, k1 = key_of(tokens(4), 4), key_of(tokens(8), 4)
    assert cache.take_events() == [
        BlockStored(k0, root_hash(None), 4),
        BlockStored(k1, k0, 4),
        SnapshotStored(k1, 4),
    ]
    assert reuse_of(cache, tokens(10)) == (8, 8, 9)
    b = make_request("b", prompt=tokens(9, OTHER))
    run_b = admit(cache, b, points=[])
    advance(cache, b, 9)  # 3 blocks: the 2 never cached, then block 1 (node 1) is evicted
    assert run_b == 0 and cache.block_table("b") == [3, 2, 1]
    assert cache.take_events() == [SnapshotRemoved(k1, 4), BlockRemoved(k1)]
    assert reuse_of(cache, tokens(10)) == (0, 4, 9)  # degraded: block 0 has no snapshot
    cache.free(b)
    c = make_request("c", prompt=tokens(16, 2 * OTHER))
    admit(cache, c, points=[])
    advance(cache, c, 16)
    assert cache.take_events() == [BlockRemoved(k0)]
    assert next(cache.tree.nodes(), None) is None
    cache.free(c)
    assert_cache_at_baseline(cache)


def test_clear_removes_children_before_parents():
    cache = small_cache()
    commit_nine(cache, points=(4, 8))
    cache.take_events()
    k0, k1 = key_of(tokens(4), 4), key_of(tokens(8), 4)
    cache.clear()
    assert cache.take_events() == [
        SnapshotRemoved(k1, 4),
        BlockRemoved(k1),
        SnapshotRemoved(k0, 4),
        BlockRemoved(k0),
    ]
    assert_cache_at_baseline(cache)


@pytest.mark.parametrize(("snapshots", "reused"), [(2, 4), (1, 0)])
def test_a_full_snapshot_pool_evicts_the_oldest_snapshot(snapshots, reused):
    cache = small_cache(snapshots=snapshots)
    commit_nine(cache, points=(4, 8))
    k0, k1 = key_of(tokens(4), 4), key_of(tokens(8), 4)
    expected = [BlockStored(k0, root_hash(None), 4), SnapshotStored(k0, 4)]
    expected += [BlockStored(k1, k0, 4)]
    if snapshots == 1:
        expected += [SnapshotRemoved(k0, 4)]
    assert cache.take_events() == [*expected, SnapshotStored(k1, 4)]
    slot_at_8 = 2 if snapshots == 1 else 3
    assert take_ops(cache) == [("copy_slot", 0, 2), ("copy_slot", 0, slot_at_8)]
    # A fork inside block 1 needs the snapshot at 4.
    assert reuse_of(cache, tokens(6) + tokens(3, OTHER))[0] == reused
    assert reuse_of(cache, tokens(10))[0] == 8
    assert_cache_at_baseline(cache)


def test_a_snapshot_superseded_on_its_own_path_is_evicted_before_older_ones():
    cache = make_prefix_cache(4, 16, snapshots=3)
    run(cache, make_request("a", prompt=tokens(9, OTHER)), 8, 9, points=[8])  # oldest
    run(cache, make_request("b", prompt=tokens(9)), 4, 8, 9, points=[4, 8])  # 4 superseded
    cache.take_events()
    run(cache, make_request("c", prompt=tokens(5, 2 * OTHER)), 4, 5, points=[4])
    # C's snapshot takes the slot of B's snapshot at 4, not the least recently used one (A's).
    events = cache.take_events()
    assert SnapshotRemoved(key_of(tokens(4), 4), 4) in events
    assert not any(isinstance(e, SnapshotRemoved) and e.coverage == 8 for e in events)
    assert reuse_of(cache, tokens(10, OTHER))[0] == 8
    assert reuse_of(cache, tokens(10))[0] == 8
    assert reuse_of(cache, [*tokens(6), 7_777, 7_778])[0] == 0  # the fork at 4 is gone
    assert_cache_at_baseline(cache)


def test_the_snapshot_where_a_system_prompt_ends_is_not_superseded_by_deeper_ones():
    """B's system prompt ends at 4: its snapshot there serves other conversations, so B's
    deeper snapshot at 8 leaves it in its place, and C's commit evicts A's, the least
    recently used one, as if B's snapshot at 4 were any other."""
    cache = make_prefix_cache(4, 16, snapshots=3)
    run(cache, make_request("a", prompt=tokens(9, OTHER)), 8, 9, points=[8])  # oldest
    b = make_request("b", prompt=tokens(9))
    b.system_prompt_len = 4
    run(cache, b, 4, 8, 9, points=[4, 8])
    cache.take_events()
    run(cache, make_request("c", prompt=tokens(5, 2 * OTHER)), 4, 5, points=[4])
    events = cache.take_events()
    assert SnapshotRemoved(key_of(tokens(8, OTHER), 4), 4) in events  # A's, at 8
    assert not any(
        isinstance(e, SnapshotRemoved) and e.block_hash == key_of(tokens(4), 4) for e in events
    )
    assert reuse_of(cache, [*tokens(6), 7_777, 7_778])[0] == 4  # another conversation
    assert reuse_of(cache, tokens(10, OTHER))[0] == 0
    assert_cache_at_baseline(cache)


def test_without_snapshot_slots_blocks_are_committed_but_nothing_is_reusable():
    cache = small_cache(snapshots=0)
    commit_nine(cache)
    assert [type(e) for e in cache.take_events()] == [BlockStored, BlockStored]
    assert take_ops(cache) == []  # no snapshot copy was taken
    assert reuse_of(cache, tokens(10)) == (0, 8, 9)
    assert_cache_at_baseline(cache)


def test_without_a_block_for_the_partial_copy_the_commit_stops_there():
    cache = small_cache()
    request = make_request("a", prompt=tokens(16))
    admit(cache, request, points=[14])
    advance(cache, request, 14)  # all 4 blocks are the request's: none left for a copy
    k0, k1, k2 = (key_of(tokens(n), 4) for n in (4, 8, 12))
    assert cache.take_events() == [
        BlockStored(k0, root_hash(None), 4),
        BlockStored(k1, k0, 4),
        BlockStored(k2, k1, 4),
    ]
    assert take_ops(cache) == []
    assert reuse_of(cache, tokens(16)) == (0, 12, 15)
    cache.free(request)
    assert_cache_at_baseline(cache)


def test_reusing_a_snapshot_makes_it_the_most_recently_used():
    cache = make_prefix_cache(4, 8, snapshots=2)  # blocks to spare: only snapshots evict
    x, y, z = tokens(5, OTHER), tokens(5, 2 * OTHER), tokens(5, 3 * OTHER)
    for request_id, prompt in (("x", x), ("y", y)):
        run(cache, make_request(request_id, prompt=prompt), 4, 5, points=[4])
    assert run(cache, make_request("x2", prompt=[*x, 1]), 5, points=[]) == 4  # touches x's
    cache.take_events()
    run(cache, make_request("z", prompt=z), 4, 5, points=[4])
    ky, kz = key_of(y[:4], 4), key_of(z[:4], 4)
    assert cache.take_events() == [
        BlockStored(kz, root_hash(None), 4),
        SnapshotRemoved(ky, 4),  # y's, the least recently used: x's was just reused
        SnapshotStored(kz, 4),
    ]
    assert reuse_of(cache, [*x, 1]) == (4, 4, 5)
    assert reuse_of(cache, [*y, 1]) == (0, 4, 5)
    assert_cache_at_baseline(cache)


def test_allocation_fails_whole_when_the_pool_is_short():
    cache = small_cache()
    commit_nine(cache)
    hog = make_request("hog", prompt=tokens(8, OTHER))
    admit(cache, hog, points=[])
    advance(cache, hog, 8)  # takes blocks 3 and 2: only the cached 1 and 0 remain free
    take_ops(cache)
    cache.take_events()
    b = make_request("b", prompt=tokens(16))
    reuse = cache.find_reuse(b)
    assert reuse.num_tokens == 8
    # 2 shared + 2 new blocks needed, but the 2 free ones are the shared ones.
    assert cache.allocate(b, 8, reuse) is None
    assert (b.num_computed_tokens, cache.recurrent.has_slot("b")) == (0, False)
    assert (take_ops(cache), cache.take_events()) == ([], [])
    assert cache.num_free_blocks == 2 and cache.attention.pool.num_cached == 2
    cache.check_integrity()
    assert cache.allocate(b, 0, reuse) is not None  # the reused part alone fits
    assert cache.block_table("b") == [0, 1]
    cache.free(b)
    cache.free(hog)
    assert_cache_at_baseline(cache)
