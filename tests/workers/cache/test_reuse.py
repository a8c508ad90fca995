"""Snapshot-aware prefix reuse through HybridCacheManager (spec 2.2-2.8, 5): what a prompt
can reuse after other requests committed, what `allocate` does with it, eviction, host tier.

Committing requests are driven as the scheduler drives them: `allocate` a chunk, advance
`num_computed_tokens`, `commit`, and `free` when done. Integrity is checked after each step.
The spec's lookup lengths exclude the prompt's last token (`find_reuse` drops it itself), so
a "lookup of n tokens" is a prompt of n + 1 tokens here.
"""

from __future__ import annotations

import pytest

from hybridserve.workers.cache.events import (
    BlockRemoved,
    BlockStored,
    SnapshotRemoved,
    SnapshotStored,
)
from hybridserve.workers.cache.hashing import block_hash, root_hash
from hybridserve.workers.cache.manager import CacheStats
from hybridserve.workers.config import EngineConfig
from tests.helpers import (
    assert_cache_at_baseline,
    executor_of,
    make_prefix_cache,
    make_request,
    tokens,
)

A = tokens(300)  # request A of the spec's end-to-end example (2.6)
OTHER = 10_000  # first id of token runs that share nothing with A


def admit(cache, request, points=None):
    """First scheduling: set the points, look up, take the reusable prefix; returns R."""
    request.expect_snapshot_points = cache.snapshot_points(request) if points is None else points
    reuse = cache.find_reuse(request)
    assert cache.allocate(request, 0, reuse) is not None
    assert request.num_computed_tokens == reuse.num_tokens
    cache.check_integrity()
    return reuse.num_tokens


def advance(cache, request, *positions):
    """Compute the prompt up to each position in turn, committing after each step."""
    for position in positions:
        assert cache.allocate(request, position - request.num_computed_tokens) is not None
        request.num_computed_tokens = position
        cache.commit(request)
        cache.check_integrity()


def run(cache, request, *positions, points=None):
    """A whole request: admit, compute to each position, free. Returns R."""
    reused = admit(cache, request, points)
    advance(cache, request, *positions)
    cache.free(request)
    cache.check_integrity()
    return reused


def reuse_of(cache, prompt, cache_salt=None, request_id="probe"):
    """(R, attention-only length, lookup length) for a new request with `prompt`."""
    request = make_request(request_id, prompt=prompt)
    request.cache_salt = cache_salt
    reuse = cache.find_reuse(request)
    return reuse.num_tokens, reuse.attention_only_len, reuse.lookup_len


def tree_layout(cache):
    """(ordinal, tokens, device block, snapshot coverage) per node, in block order."""
    return sorted(
        (n.ordinal, n.num_tokens, n.block_id, n.snapshot.coverage if n.snapshot else None)
        for n in cache.tree.nodes()
    )


def key_of(prompt, block_size):
    """Prefix-tree key of the (possibly partial) last block of `prompt`."""
    key = root_hash(None)
    for start in range(0, len(prompt), block_size):
        key = block_hash(key, prompt[start : start + block_size])
    return key


# ---- the end-to-end example of spec 2.6 (block size 32, interval 128, save-last) ----------


def commit_a(cache):
    a = make_request("a", prompt=A)
    assert cache.snapshot_points(a) == [128, 256, 300]
    assert run(cache, a, 128, 256, 300) == 0
    return a


def test_a_commits_blocks_and_snapshots_at_its_points():
    cache = make_prefix_cache(32, 64, interval=128)
    commit_a(cache)
    assert tree_layout(cache) == [
        (0, 32, 0, None),
        (1, 32, 1, None),
        (2, 32, 2, None),
        (3, 32, 3, 32),  # position 128
        (4, 32, 4, None),
        (5, 32, 5, None),
        (6, 32, 6, None),
        (7, 32, 7, 32),  # position 256
        (8, 32, 8, None),
        (9, 12, 10, 12),  # position 300: the tree's own copy of a's partial block 9
    ]
    assert executor_of(cache).calls == [
        ("copy_slot", 0, 2),
        ("copy_slot", 0, 3),
        ("copy_block", 9, 10, 12),
        ("copy_slot", 0, 4),
    ]
    assert sorted(n.snapshot.position for n in cache.tree.nodes() if n.snapshot) == [128, 256, 300]
    assert (cache.blocks.pool.num_cached, cache.num_free_blocks) == (10, 64)
    assert_cache_at_baseline(cache)


def test_b_extends_a_and_reuses_the_prompt_end_snapshot():
    cache = make_prefix_cache(32, 64, interval=128, partial=True)
    commit_a(cache)
    executor_of(cache).take()
    b = make_request("b", prompt=A + tokens(100, OTHER))
    b.expect_snapshot_points = cache.snapshot_points(b)
    assert b.expect_snapshot_points == [128, 256, 384, 400]
    reuse = cache.find_reuse(b)
    assert (reuse.num_tokens, reuse.attention_only_len, reuse.lookup_len) == (300, 300, 399)
    allocation = cache.allocate(b, 84, reuse)  # the chunk to the next point, 384
    assert allocation is not None
    assert (allocation.new_block_ids, allocation.live_slot) == ([11, 12, 13], 0)
    assert allocation.reused_tokens == 300
    # Full blocks 0-8 are the tree's own; block 9 is a private copy of the first 12 rows of
    # the tree's partial block 10; the live slot starts as the snapshot at 300 (slot 4).
    assert cache.block_table("b") == [0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13]
    assert executor_of(cache).take() == [("copy_block", 10, 11, 12), ("copy_slot", 4, 0)]
    assert b.num_computed_tokens == b.num_cached_tokens == 300
    cache.check_integrity()
    advance(cache, b, 384)
    # Block 9 becomes full: it replaces the 12-token node and adopts its snapshot at 300.
    assert reuse_of(cache, A + tokens(50, OTHER))[0] == 300
    cache.free(b)
    assert_cache_at_baseline(cache)


def test_b_without_partial_reuse_falls_back_to_the_last_aligned_snapshot():
    cache = make_prefix_cache(32, 64, interval=128, partial=False)
    commit_a(cache)
    executor_of(cache).take()
    b = make_request("b", prompt=A + tokens(100, OTHER))
    b.expect_snapshot_points = cache.snapshot_points(b)
    reuse = cache.find_reuse(b)
    # The match stops at 288 (full blocks only); block 8 has no snapshot, block 7 has.
    assert (reuse.num_tokens, reuse.attention_only_len, reuse.lookup_len) == (256, 288, 399)
    allocation = cache.allocate(b, 128, reuse)
    assert allocation.new_block_ids == [11, 12, 13, 14]
    assert cache.block_table("b") == [0, 1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 14]
    assert executor_of(cache).take() == [("copy_slot", 3, 0)]  # aligned: no block copy
    assert b.num_computed_tokens == b.num_cached_tokens == 256
    cache.free(b)
    assert_cache_at_baseline(cache)


def test_c_an_exact_repeat_reuses_only_the_previous_boundary():
    cache = make_prefix_cache(32, 64, interval=128)
    commit_a(cache)
    cache.take_events()
    c = make_request("c", prompt=A)
    # Lookup 299 tokens: block 9 matches 11 < 12 tokens, so the snapshot at 300 is unusable.
    assert reuse_of(cache, A) == (256, 299, 299)
    assert admit(cache, c) == 256
    advance(cache, c, 300)
    # Everything c commits already exists: it takes the tree's block 8, publishes nothing.
    assert cache.take_events() == []
    assert cache.block_table("c")[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    cache.free(c)
    assert_cache_at_baseline(cache)


# ---- the smaller worked examples of spec 2.5 / 2.6 --------------------------------------


@pytest.mark.parametrize(
    ("partial", "probes"),
    [
        # (lookup tokens shared with the committer, lookup length) -> (R, attention-only)
        (True, [((32, 32), (32, 32)), ((48, 48), (32, 48)), ((64, 96), (64, 64))]),
        (False, [((32, 32), (32, 32)), ((48, 48), (32, 32)), ((64, 96), (64, 64))]),
    ],
)
def test_commits_at_32_and_64_leave_both_snapshots(partial, probes):
    cache = make_prefix_cache(32, 16, partial=partial)
    committer = tokens(70)
    run(cache, make_request("a", prompt=committer), 32, 64, 70, points=[32, 64])
    assert tree_layout(cache) == [(0, 32, 0, 32), (1, 32, 1, 32)]
    for (shared, lookup_len), expected in probes:
        prompt = committer[:shared] + tokens(lookup_len + 1 - shared, OTHER)
        assert reuse_of(cache, prompt) == (*expected, lookup_len)


@pytest.mark.parametrize(("shared", "reused"), [(128, 128), (100, 64), (63, 0)])
def test_t8_interval_snapshots_serve_longer_prompts(shared, reused):
    cache = make_prefix_cache(32, 16, interval=64, save_last=False)
    committer = tokens(128)
    run(cache, make_request("a", prompt=committer), 64, 128)
    prompt = committer[:shared] + tokens(200 - shared, OTHER)
    assert reuse_of(cache, prompt)[0] == reused


def test_same_block_forks_never_reuse_a_snapshot_past_the_fork():
    cache = make_prefix_cache(32, 16)
    r1 = make_request("r1", prompt=tokens(50))
    admit(cache, r1, points=[10, 20, 32])
    advance(cache, r1, 10, 20)
    # Latest checkpoint wins: only the snapshot at 20 is left in block 0.
    assert [(n.num_tokens, n.snapshot.coverage) for n in cache.tree.nodes()] == [(20, 20)]

    def fork(shared):
        return r1.prompt_token_ids[:shared] + tokens(40 - shared, OTHER)

    assert reuse_of(cache, fork(15)) == (0, 15, 39)  # 20 lies in its future
    assert reuse_of(cache, fork(25)) == (20, 20, 39)
    advance(cache, r1, 32)  # block-aligned commit: the block is full, its snapshot at 32
    assert [(n.num_tokens, n.snapshot.coverage) for n in cache.tree.nodes()] == [(32, 32)]
    assert reuse_of(cache, r1.prompt_token_ids[:40] + tokens(10, OTHER)) == (32, 32, 49)
    assert reuse_of(cache, fork(25)) == (0, 25, 39)  # the snapshot at 20 is gone: a miss
    cache.free(r1)
    assert_cache_at_baseline(cache)


def test_same_block_commits_replace_the_shorter_node_and_its_snapshot():
    cache = make_prefix_cache(32, 16)
    r1 = make_request("r1", prompt=tokens(50))
    admit(cache, r1, points=[10, 20])
    advance(cache, r1, 10)
    k10, k20 = key_of(tokens(10), 32), key_of(tokens(20), 32)
    assert cache.take_events() == [BlockStored(k10, root_hash(None), 10), SnapshotStored(k10, 10)]
    executor_of(cache).take()
    advance(cache, r1, 20)
    # The 20-token node registers first, adopts the snapshot at 10, drops the 10-token node,
    # then its own snapshot at 20 replaces the adopted one.
    assert cache.take_events() == [
        BlockStored(k20, root_hash(None), 20),
        SnapshotRemoved(k10, 10),
        SnapshotStored(k20, 10, k10),  # the adopted snapshot still keys the first 10 tokens
        BlockRemoved(k10),
        SnapshotRemoved(k20, 10),
        SnapshotStored(k20, 20),
    ]
    # r1 holds blocks [0]; the 10-token node's copy was block 1, the new copy is block 2.
    assert executor_of(cache).take() == [("copy_block", 0, 2, 20), ("copy_slot", 0, 3)]
    assert cache.states.snapshots.num_free == 7
    assert cache.blocks.pool.num_cached == 1
    cache.free(r1)
    assert_cache_at_baseline(cache)


def test_a_snapshot_beyond_the_fork_is_not_reused_until_one_at_the_fork_exists():
    cache = make_prefix_cache(32, 16)
    r1 = tokens(100)
    run(cache, make_request("r1", prompt=r1), 96, 100, points=[96])  # one commit of 96
    r3 = r1[:64] + tokens(36, OTHER)
    assert reuse_of(cache, r3) == (0, 64, 99)  # R <= attention-only <= lookup
    r2 = r1[:64] + tokens(36, 2 * OTHER)
    assert run(cache, make_request("r2", prompt=r2), 64, 96, 100, points=[64, 96]) == 0
    assert reuse_of(cache, r3) == (64, 64, 99)
    # Nothing past 96 was committed: both full prompts reuse (and match) 96.
    assert reuse_of(cache, r2) == (96, 96, 99)
    assert reuse_of(cache, r1) == (96, 96, 99)
    assert_cache_at_baseline(cache)


@pytest.mark.parametrize(("partial", "reused"), [(False, 32), (True, 48)])
def test_partial_snapshot_needs_partial_reuse(partial, reused):
    cache = make_prefix_cache(32, 16, partial=partial)
    committer = tokens(60)
    run(cache, make_request("a", prompt=committer), 32, 48, 60, points=[32, 48])
    # The 48-token endpoint: a 16-token node in block 1 with coverage 16.
    assert [(o, n, c) for o, n, _, c in tree_layout(cache)] == [(0, 32, 32), (1, 16, 16)]
    prompt = committer[:48] + tokens(17, OTHER)  # prompt 65, lookup 64
    assert reuse_of(cache, prompt)[0] == reused


def test_monotonic_multi_turn_in_one_block():
    cache = make_prefix_cache(32, 16)
    conversation = tokens(26, OTHER)
    reused = []
    for turn, lookup_len in enumerate((10, 20, 25)):
        request = make_request(f"turn{turn}", prompt=conversation[: lookup_len + 1])
        reused.append(run(cache, request, lookup_len, lookup_len + 1, points=[lookup_len]))
    assert reused == [0, 10, 20]
    assert reuse_of(cache, conversation) == (25, 25, 25)
    assert [(n.num_tokens, n.snapshot.coverage) for n in cache.tree.nodes()] == [(25, 25)]
    assert_cache_at_baseline(cache)


def test_a_shorter_endpoint_survives_when_a_later_turn_fills_its_block():
    # Spec 2.2: turn 1 snapshots at 48; turn 2 fills block 1 and snapshots only at 96.
    cache = make_prefix_cache(32, 16)
    conversation = tokens(97)
    assert run(cache, make_request("t1", prompt=conversation[:49]), 48, 49, points=[48]) == 0
    k0, k1_partial = key_of(conversation[:32], 32), key_of(conversation[:48], 32)
    k1, k2 = key_of(conversation[:64], 32), key_of(conversation[:96], 32)
    cache.take_events()
    t2 = make_request("t2", prompt=conversation)
    assert admit(cache, t2, points=[96]) == 48
    advance(cache, t2, 96)
    assert cache.take_events() == [
        BlockStored(k1, k0, 32),
        SnapshotRemoved(k1_partial, 16),
        SnapshotStored(k1, 16, k1_partial),  # adopted: the endpoint at 48 stays reusable
        BlockRemoved(k1_partial),
        BlockStored(k2, k1, 32),
        SnapshotStored(k2, 32),
    ]
    advance(cache, t2, 97)
    cache.free(t2)
    assert [(o, n, c) for o, n, _, c in tree_layout(cache)] == [
        (0, 32, None),
        (1, 32, 16),
        (2, 32, 32),
    ]
    assert reuse_of(cache, conversation[:60] + tokens(10, OTHER)) == (48, 60, 69)
    assert reuse_of(cache, [*conversation, 1]) == (96, 96, 97)
    assert_cache_at_baseline(cache)


@pytest.mark.parametrize(
    ("committed", "points", "prompt_len", "stats"),
    [
        (0, [], 49, (1, 0, 1, 0, 48, 0, 0)),  # miss: 48-token lookup, no snapshot
        (49, [32], 49, (1, 1, 0, 32, 16, 1, 0)),  # aligned hit: snapshot 32, lookup 48
        (60, [32, 48], 65, (1, 1, 0, 48, 16, 0, 1)),  # unaligned hit: snapshot 48, lookup 64
    ],
    ids=["miss", "aligned", "unaligned"],
)
def test_lookup_stats(committed, points, prompt_len, stats):
    cache = make_prefix_cache(32, 16)
    prompt = tokens(max(committed, prompt_len))
    if committed:
        run(cache, make_request("a", prompt=prompt[:committed]), *points, committed, points=points)
    cache.stats = CacheStats()
    request = make_request("b", prompt=prompt[:prompt_len])
    reuse = cache.find_reuse(request)
    assert cache.stats.as_tuple() == (0,) * 7  # looking up records nothing
    assert cache.allocate(request, prompt_len - reuse.num_tokens, reuse) is not None
    assert cache.stats.as_tuple() == stats


def test_cache_salts_never_share():
    cache = make_prefix_cache(32, 16)
    prompt = tokens(65)
    a = make_request("a", prompt=prompt)
    a.cache_salt = "tenant-a"
    run(cache, a, 64, 65, points=[64])
    assert reuse_of(cache, prompt, "tenant-a") == (64, 64, 64)
    assert reuse_of(cache, prompt, "tenant-b") == (0, 0, 64)
    assert reuse_of(cache, prompt, None) == (0, 0, 64)
    b = make_request("b", prompt=prompt)
    b.cache_salt = "tenant-b"
    assert run(cache, b, 64, 65, points=[64]) == 0
    # Same tokens, two scopes: two disjoint copies of both blocks.
    assert [(o, b) for o, _, b, _ in tree_layout(cache)] == [(0, 0), (0, 3), (1, 1), (1, 4)]
    assert_cache_at_baseline(cache)


def test_find_reuse_is_side_effect_free():
    cache = make_prefix_cache(32, 64, interval=128)
    commit_a(cache)
    executor_of(cache).take()
    cache.take_events()
    pool, snapshots = cache.blocks.pool, cache.states.snapshots
    before = (list(pool._free), list(snapshots._lru), cache.stats.as_tuple())
    b = make_request("b", prompt=[*A, 1])
    assert cache.find_reuse(b).num_tokens == 300
    assert cache.find_reuse(b).num_tokens == 300  # may be called more than once
    assert (list(pool._free), list(snapshots._lru), cache.stats.as_tuple()) == before
    assert (executor_of(cache).calls, cache.take_events()) == ([], [])
    assert b.num_computed_tokens == b.num_cached_tokens == 0


# ---- invariants (spec 5) -----------------------------------------------------------------


def test_i1_commits_happen_only_at_points():
    # Spec 2.4: prompt 150, points [137]: one commit of tokens [0, 137) at position 137.
    cache = make_prefix_cache(32, 16)
    request = make_request("a", prompt=tokens(150))
    admit(cache, request, points=[137])
    advance(cache, request, 96, 128)  # chunk ends that are not points (e.g. budget cuts)
    assert cache.take_events() == []
    advance(cache, request, 137)
    events = cache.take_events()
    assert [(type(e), getattr(e, "num_tokens", None)) for e in events] == [
        *[(BlockStored, 32)] * 4,
        (BlockStored, 9),
        (SnapshotStored, None),
    ]
    assert events[-1] == SnapshotStored(key_of(tokens(137), 32), 9)
    advance(cache, request, 150)  # past the last point: the prompt end is not published
    assert cache.take_events() == []
    cache.free(request)
    assert sorted(n.snapshot.position for n in cache.tree.nodes() if n.snapshot) == [137]


def test_i1_no_points_no_commit():
    cache = make_prefix_cache(32, 16)
    run(cache, make_request("a", prompt=tokens(100)), 64, 100, points=[])
    assert cache.take_events() == []
    assert next(cache.tree.nodes(), None) is None


def test_i8_free_removes_the_request_state():
    cache = make_prefix_cache(32, 16)
    request = make_request("a", prompt=tokens(100))
    admit(cache, request, points=[64, 100])
    advance(cache, request, 40)
    cache.free(request)
    assert not cache.states.has_slot("a") and not cache.blocks.has_table("a")
    with pytest.raises(KeyError):
        cache.block_table("a")
    # A freed request commits nothing, even when its cursor sits on a point.
    request.num_computed_tokens = 64
    cache.commit(request)
    assert cache.take_events() == []
    cache.check_integrity()
    assert (cache.num_free_blocks, cache.num_free_slots) == (16, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_mamba_slots": 4, "max_num_seqs": 8}, r"num_mamba_slots \(4\) is smaller than"),
        (
            {"mamba_snapshot_interval": 0, "mamba_save_last_snapshot": False},
            "no Mamba snapshot points would never reuse anything",
        ),
    ],
)
def test_i11_engine_config_rejects_impossible_capacity(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)


def test_i11_engine_config_snapshot_slots():
    assert EngineConfig(max_num_seqs=8, num_mamba_slots=20).num_snapshot_slots == 12
    assert EngineConfig(max_num_seqs=8).num_snapshot_slots == 64
    assert EngineConfig(max_num_seqs=40).num_snapshot_slots == 80
    assert EngineConfig(max_num_seqs=8, enable_prefix_caching=False).num_snapshot_slots == 0
    # Without prefix caching no snapshot point is needed.
    EngineConfig(enable_prefix_caching=False, mamba_save_last_snapshot=False)


def test_i17_the_last_prompt_token_is_never_reused():
    cache = make_prefix_cache(32, 16, interval=0, save_last=True)
    prompt = tokens(64)
    run(cache, make_request("a", prompt=prompt), 64)
    assert cache.snapshot_points(make_request("a", prompt=prompt)) == [64]
    assert reuse_of(cache, prompt) == (0, 63, 63)  # exact repeat: lookup one shorter
    assert reuse_of(cache, [*prompt, 1]) == (64, 64, 64)
    assert reuse_of(cache, prompt[:1]) == (0, 0, 0)
    opted_out = make_request("b", prompt=[*prompt, 1])
    opted_out.reuse_prefix = False
    assert cache.find_reuse(opted_out).num_tokens == 0


# ---- eviction (device pools only) --------------------------------------------------------


def small_cache(**kwargs):
    """Block size 4, 4 blocks, 2 live slots (0, 1); snapshot slots start at 2."""
    return make_prefix_cache(4, 4, **{"snapshots": 4, **kwargs})


def commit_nine(cache, points=(8,)):
    """Prompt 1..9 committed to 8: blocks 0 and 1 cached, free queue [3, 2, 1, 0]."""
    run(cache, make_request("a", prompt=tokens(9)), *points, 9, points=list(points))


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
    assert executor_of(cache).calls == [("copy_slot", 0, 2), ("copy_slot", 0, slot_at_8)]
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


def test_without_snapshot_slots_blocks_are_committed_but_nothing_is_reusable():
    cache = small_cache(snapshots=0)
    commit_nine(cache)
    assert [type(e) for e in cache.take_events()] == [BlockStored, BlockStored]
    assert executor_of(cache).calls == []  # no snapshot copy was taken
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
    assert executor_of(cache).calls == []
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
    executor_of(cache).take()
    cache.take_events()
    b = make_request("b", prompt=tokens(16))
    reuse = cache.find_reuse(b)
    assert reuse.num_tokens == 8
    # 2 shared + 2 new blocks needed, but the 2 free ones are the shared ones.
    assert cache.allocate(b, 8, reuse) is None
    assert (b.num_computed_tokens, cache.states.has_slot("b")) == (0, False)
    assert (executor_of(cache).calls, cache.take_events()) == ([], [])
    assert cache.num_free_blocks == 2 and cache.blocks.pool.num_cached == 2
    cache.check_integrity()
    assert cache.allocate(b, 0, reuse) is not None  # the reused part alone fits
    assert cache.block_table("b") == [0, 1]
    cache.free(b)
    cache.free(hog)
    assert_cache_at_baseline(cache)


# ---- host tier ---------------------------------------------------------------------------


def evict_to_host(cache, start=OTHER):
    """An unrelated 16-token request takes every device block, then goes."""
    x = make_request(f"x{start}", prompt=tokens(16, start))
    admit(cache, x, points=[])
    advance(cache, x, 16)
    cache.free(x)


def test_an_evicted_block_goes_to_the_host_and_a_hit_loads_it_back():
    cache = small_cache(host_blocks=4, host_slots=4)
    commit_nine(cache)
    executor_of(cache).take()
    cache.take_events()
    evict_to_host(cache)
    # Deepest first: node 1 (block 1) -> host 0, node 0 (block 0) -> host 1. No node left.
    assert executor_of(cache).take() == [("offload_block", 1, 0), ("offload_block", 0, 1)]
    assert cache.take_events() == []
    assert [(n.block_id, n.host_block_id) for n in cache.tree.nodes()] == [(None, 0), (None, 1)]
    b = make_request("b", prompt=tokens(10))
    reuse = cache.find_reuse(b)
    assert reuse.num_tokens == 8
    allocation = cache.allocate(b, 2, reuse)
    assert allocation.new_block_ids == [2]
    assert cache.block_table("b") == [0, 1, 2]
    assert executor_of(cache).take() == [
        ("load_block", 1, 0),
        ("load_block", 0, 1),
        ("copy_slot", 2, 0),
    ]
    assert sorted((n.ordinal, n.block_id, n.host_block_id) for n in cache.tree.nodes()) == [
        (0, 0, None),
        (1, 1, None),
    ]
    assert cache.host.blocks.ids.num_free == 4
    cache.free(b)
    assert_cache_at_baseline(cache)


def test_a_partially_used_block_on_the_host_is_loaded_into_the_private_copy():
    cache = small_cache(host_blocks=4, host_slots=4)
    run(cache, make_request("a", prompt=tokens(7)), 6, 7, points=[6])
    # Node 0 = block 0, node 1 = the tree's copy (block 2) of a's 2-row block 1.
    assert tree_layout(cache) == [(0, 4, 0, None), (1, 2, 2, 2)]
    executor_of(cache).take()
    evict_to_host(cache)
    assert executor_of(cache).take() == [("offload_block", 2, 0), ("offload_block", 0, 1)]
    b = make_request("b", prompt=tokens(6) + tokens(3, OTHER))
    reuse = cache.find_reuse(b)
    assert reuse.num_tokens == 6
    assert cache.allocate(b, 3, reuse).new_block_ids == [1, 2]
    assert cache.block_table("b") == [0, 1, 2]
    assert executor_of(cache).take() == [
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
    assert executor_of(cache).take() == [
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
    assert executor_of(cache).take() == [("load_slot", 0, 0), ("copy_slot", 0, 2)]
    assert cache.take_events() == [SnapshotRemoved(k1, 4)]
    node0 = next(n for n in cache.tree.nodes() if n.ordinal == 0)
    assert (node0.snapshot.slot, node0.snapshot.host_slot) == (2, None)
    cache.free(b)
    assert_cache_at_baseline(cache)


def test_the_host_tier_drops_its_oldest_entry_and_the_node_leaves():
    cache = small_cache(host_blocks=1)
    commit_nine(cache)
    executor_of(cache).take()
    cache.take_events()
    k0, k1 = key_of(tokens(4), 4), key_of(tokens(8), 4)
    evict_to_host(cache)
    # Node 1 goes to host 0; node 0 needs the host block: node 1 has no copy left.
    assert executor_of(cache).take() == [("offload_block", 1, 0), ("offload_block", 0, 0)]
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
    executor_of(cache).take()
    evict_to_host(cache, 3 * OTHER)
    # r2's own block 1 goes to the host; node 0 keeps its existing host copy.
    assert executor_of(cache).take() == [("offload_block", 1, 2)]
    assert (node0.block_id, node0.host_block_id) == (None, 1)
    assert cache.host.blocks.ids.num_free == 1
    assert_cache_at_baseline(cache)
