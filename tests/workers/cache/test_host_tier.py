"""The host tier under CacheCoordinator: evicted blocks and snapshots go to host memory, a
hit loads them back, and the tier's own evictions take the node out of the tree."""

from __future__ import annotations

from hybridserve.workers.cache.events import (
    BlockRemoved,
    SnapshotRemoved,
)
from tests.helpers import (
    assert_cache_at_baseline,
    make_request,
    take_ops,
    tokens,
)
from tests.workers.cache.drive import (
    OTHER,
    commit_nine,
    evict_to_host,
    key_of,
    reuse_of,
    run,
    small_cache,
    tree_layout,
)


def test_an_evicted_block_goes_to_the_host_and_a_hit_loads_it_back():
    cache = small_cache(host_blocks=4, host_slots=4)
    commit_nine(cache)
    take_ops(cache)
    cache.take_events()
    evict_to_host(cache)
    # Deepest first: node 1 (block 1) -> host 0, node 0 (block 0) -> host 1. No node left.
    assert take_ops(cache) == [("offload_block", 1, 0), ("offload_block", 0, 1)]
    assert cache.take_events() == []
    assert [(n.block_id, n.host_block_id) for n in cache.tree.nodes()] == [(None, 0), (None, 1)]
    b = make_request("b", prompt=tokens(10))
    reuse = cache.find_reuse(b)
    assert reuse.num_tokens == 8
    allocation = cache.allocate(b, 2, reuse)
    assert allocation.new_block_ids == [2]
    assert cache.block_table("b") == [0, 1, 2]
    assert take_ops(cache) == [
        ("load_block", 1, 0),
        ("load_block", 0, 1),
        ("copy_slot", 2, 0),
    ]
    assert sorted((n.ordinal, n.block_id, n.host_block_id) for n in cache.tree.nodes()) == [
        (0, 0, None),
        (1, 1, None),
    ]
    assert cache.attention.host.ids.num_free == 4
    cache.free(b)
    assert_cache_at_baseline(cache)


def test_a_partially_used_block_on_the_host_is_loaded_into_the_private_copy():
    cache = small_cache(host_blocks=4, host_slots=4)
    run(cache, make_request("a", prompt=tokens(7)), 6, 7, points=[6])
    # Node 0 = block 0, node 1 = the tree's copy (block 2) of a's 2-row block 1.
    assert tree_layout(cache) == [(0, 4, 0, None), (1, 2, 2, 2)]
    take_ops(cache)
    evict_to_host(cache)
    assert take_ops(cache) == [("offload_block", 2, 0), ("offload_block", 0, 1)]
    b = make_request("b", prompt=tokens(6) + tokens(3, OTHER))
    reuse = cache.find_reuse(b)
    assert reuse.num_tokens == 6
    assert cache.allocate(b, 3, reuse).new_block_ids == [1, 2]
    assert cache.block_table("b") == [0, 1, 2]
    assert take_ops(cache) == [
        ("load_block", 1, 0),  # node 0 promoted to the device
        ("load_block", 0, 1),  # node 1's rows into b's private block
        ("copy_slot", 2, 0),
    ]
    assert sorted((n.ordinal, n.block_id, n.host_block_id) for n in cache.tree.nodes()) == [
        (0, 0, None),
        (1, None, 0),  # still only on the host
    ]
    cache.free(b)
    assert_cache_at_baseline(cache)


def test_an_evicted_snapshot_goes_to_the_host_and_a_hit_loads_it_back():
    cache = small_cache(snapshots=1, host_slots=1)
    commit_nine(cache, points=(4, 8))
    k1 = key_of(tokens(8), 4)
    # The snapshot at 4 leaves slot 2 for the host when the one at 8 needs it.
    assert take_ops(cache) == [
        ("copy_slot", 0, 2),
        ("offload_slot", 2, 0),
        ("copy_slot", 0, 2),
    ]
    assert [e for e in cache.take_events() if isinstance(e, SnapshotRemoved)] == []
    b = make_request("b", prompt=tokens(6) + tokens(3, OTHER))
    reuse = cache.find_reuse(b)
    assert reuse.num_tokens == 4
    assert cache.allocate(b, 5, reuse) is not None
    # Loaded into the live slot, then back into the device pool: that evicts the snapshot
    # at 8, which finds no host room (the only host slot is the one being read) and goes.
    assert take_ops(cache) == [("load_slot", 0, 0), ("copy_slot", 0, 2)]
    assert cache.take_events() == [SnapshotRemoved(k1, 4)]
    node0 = next(n for n in cache.tree.nodes() if n.ordinal == 0)
    assert (node0.snapshot.slot, node0.snapshot.host_slot) == (2, None)
    cache.free(b)
    assert_cache_at_baseline(cache)


def test_the_host_tier_drops_its_oldest_entry_and_the_node_leaves():
    cache = small_cache(host_blocks=1)
    commit_nine(cache)
    take_ops(cache)
    cache.take_events()
    k0, k1 = key_of(tokens(4), 4), key_of(tokens(8), 4)
    evict_to_host(cache)
    # Node 1 goes to host 0; node 0 needs the host block: node 1 has no copy left.
    assert take_ops(cache) == [("offload_block", 1, 0), ("offload_block", 0, 0)]
    assert cache.take_events() == [SnapshotRemoved(k1, 4), BlockRemoved(k1)]
    assert [(n.ordinal, n.block_id, n.host_block_id) for n in cache.tree.nodes()] == [(0, None, 0)]
    assert reuse_of(cache, tokens(10)) == (0, 4, 9)
    cache.clear()
    assert cache.take_events() == [BlockRemoved(k0)]
    assert_cache_at_baseline(cache)


def test_a_block_on_device_and_host_is_not_offloaded_twice():
    cache = small_cache(host_blocks=4, host_slots=4)
    commit_nine(cache)
    evict_to_host(cache)  # node 0 -> host 1, node 1 -> host 0
    # r2 shares block 0 only and finds no snapshot there: it computes it and, committing,
    # gives the host-only node 0 a device copy again (block 0).
    r2 = make_request("r2", prompt=tokens(4) + tokens(5, 2 * OTHER))
    assert run(cache, r2, 8, 9, points=[8]) == 0
    node0 = next(n for n in cache.tree.nodes() if n.ordinal == 0)
    assert (node0.block_id, node0.host_block_id) == (0, 1)
    take_ops(cache)
    evict_to_host(cache, 3 * OTHER)
    # r2's own block 1 goes to the host; node 0 keeps its existing host copy.
    assert take_ops(cache) == [("offload_block", 1, 2)]
    assert (node0.block_id, node0.host_block_id) == (None, 1)
    assert cache.attention.host.ids.num_free == 1
    assert_cache_at_baseline(cache)
