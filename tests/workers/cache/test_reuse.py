"""Snapshot-aware prefix reuse through CacheCoordinator (docs/snapshot-reuse.md): what a prompt
can reuse after other requests committed, and what `allocate` does with it. Requests are
driven as the scheduler drives them (`drive.py`)."""

from __future__ import annotations

import pytest

from hybridserve.workers.cache.coordinator import CacheStats
from hybridserve.workers.cache.events import (
    BlockRemoved,
    BlockStored,
    SnapshotRemoved,
    SnapshotStored,
)
from hybridserve.workers.cache.hashing import root_hash
from hybridserve.workers.core.config import EngineConfig
from tests.helpers import (
    assert_cache_at_baseline,
    make_prefix_cache,
    make_request,
    take_ops,
    tokens,
)
from tests.workers.cache.drive import (
    OTHER,
    A,
    admit,
    advance,
    key_of,
    reuse_of,
    run,
    tree_layout,
)

# ---- the worked example of docs/snapshot-reuse.md (block size 32, interval 128, save-last)


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
    assert take_ops(cache) == [
        ("copy_slot", 0, 2),
        ("copy_slot", 0, 3),
        ("copy_block", 9, 10, 12),
        ("copy_slot", 0, 4),
    ]
    assert sorted(n.snapshot.position for n in cache.tree.nodes() if n.snapshot) == [128, 256, 300]
    assert (cache.attention.pool.num_cached, cache.num_free_blocks) == (10, 64)
    assert_cache_at_baseline(cache)


def test_b_extends_a_and_reuses_the_prompt_end_snapshot():
    cache = make_prefix_cache(32, 64, interval=128, partial=True)
    commit_a(cache)
    take_ops(cache)
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
    assert take_ops(cache) == [("copy_block", 10, 11, 12), ("copy_slot", 4, 0)]
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
    take_ops(cache)
    b = make_request("b", prompt=A + tokens(100, OTHER))
    b.expect_snapshot_points = cache.snapshot_points(b)
    reuse = cache.find_reuse(b)
    # The match stops at 288 (full blocks only); block 8 has no snapshot, block 7 has.
    assert (reuse.num_tokens, reuse.attention_only_len, reuse.lookup_len) == (256, 288, 399)
    allocation = cache.allocate(b, 128, reuse)
    assert allocation.new_block_ids == [11, 12, 13, 14]
    assert cache.block_table("b") == [0, 1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 14]
    assert take_ops(cache) == [("copy_slot", 3, 0)]  # aligned: no block copy
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


# ---- the smaller worked examples of docs/snapshot-reuse.md --------------------------------------


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
    take_ops(cache)
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
    assert take_ops(cache) == [("copy_block", 0, 2, 20), ("copy_slot", 0, 3)]
    assert cache.recurrent.snapshots.num_free == 7
    assert cache.attention.pool.num_cached == 1
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
    take_ops(cache)
    cache.take_events()
    pool, snapshots = cache.attention.pool, cache.recurrent.snapshots
    before = (list(pool._free), list(snapshots._lru), cache.stats.as_tuple())
    b = make_request("b", prompt=[*A, 1])
    assert cache.find_reuse(b).num_tokens == 300
    assert cache.find_reuse(b).num_tokens == 300  # may be called more than once
    assert (list(pool._free), list(snapshots._lru), cache.stats.as_tuple()) == before
    assert (take_ops(cache), cache.take_events()) == ([], [])
    assert b.num_computed_tokens == b.num_cached_tokens == 0


# ---- reuse from a prompt still in flight (docs/snapshot-reuse.md section 6.1) -------------


def in_flight_a(cache, computed: int):
    """Request A admitted and computed to `computed`, its points [128, 256, 300] ahead."""
    a = make_request("a", prompt=A)
    admit(cache, a)
    advance(cache, a, *[p for p in (128, 256) if p <= computed])
    return a


@pytest.mark.parametrize(
    ("computed", "shared", "expected"),
    [
        (0, 280, 256),  # the deepest point before the fork
        (0, 200, 128),
        (0, 100, 0),  # forks before the first point
        (128, 200, 0),  # 128 is committed already: find_reuse has it
        (128, 280, 256),
        (256, 280, 0),
    ],
)
def test_reuse_in_flight_is_the_deepest_point_ahead_before_the_fork(computed, shared, expected):
    cache = make_prefix_cache(32, 64, interval=128)
    a = in_flight_a(cache, computed)
    b = make_request("b", prompt=[*A[:shared], *tokens(100, OTHER)])
    ahead = cache.reuse_in_flight(b, [a])
    assert (ahead.position, ahead.request) == (expected, a) if expected else ahead is None
    # Once A is done, B reuses the deepest of its points before the fork.
    advance(cache, a, *[p for p in (128, 256, 300) if p > computed])
    assert cache.find_reuse(b).num_tokens == max(p for p in (0, 128, 256) if p <= shared)
    cache.free(a)
    assert_cache_at_baseline(cache)


def test_reuse_in_flight_stops_at_the_lookup_and_respects_salts_and_partial_reuse():
    cache = make_prefix_cache(32, 64, interval=128, partial=False)
    a = in_flight_a(cache, 0)
    repeat = make_request("repeat", prompt=A)  # lookup 299: the prompt end 300 is beyond it
    assert cache.reuse_in_flight(repeat, [a]).position == 256
    a.expect_snapshot_points = [100, 150]  # unaligned points, partial reuse off
    assert cache.reuse_in_flight(repeat, [a]) is None
    a.expect_snapshot_points = [128, 256, 300]
    other_tenant = make_request("other", prompt=A)
    other_tenant.cache_salt = "tenant-b"
    assert cache.reuse_in_flight(other_tenant, [a]) is None
    scored = make_request("scored", prompt=A, prompt_logprobs=0)
    assert cache.reuse_in_flight(scored, [a]) is None  # it computes its whole prompt anyway
    assert cache.reuse_in_flight(repeat, []) is None
    cache.free(a)
    assert_cache_at_baseline(cache)


# ---- invariants (labels of docs/snapshot-reuse.md) ----------------------------------------


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
    assert not cache.recurrent.has_slot("a") and not cache.attention.has_table("a")
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
        ({"num_state_slots": 4, "max_num_seqs": 8}, r"num_state_slots \(4\) is smaller than"),
        (
            {"snapshot_interval": 0, "save_last_snapshot": False},
            "no snapshot points would never reuse anything",
        ),
    ],
)
def test_i11_engine_config_rejects_impossible_capacity(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)


def test_i11_engine_config_snapshot_slots():
    assert EngineConfig(max_num_seqs=8, num_state_slots=20).num_snapshot_slots == 12
    assert EngineConfig(max_num_seqs=8).num_snapshot_slots == 64
    assert EngineConfig(max_num_seqs=40).num_snapshot_slots == 80
    assert EngineConfig(max_num_seqs=8, enable_prefix_caching=False).num_snapshot_slots == 0
    # Without prefix caching no snapshot point is needed.
    EngineConfig(enable_prefix_caching=False, save_last_snapshot=False)


def test_i17_the_last_prompt_token_is_never_reused():
    cache = make_prefix_cache(32, 16, interval=0, save_last=True)
    prompt = tokens(64)
    run(cache, make_request("a", prompt=prompt), 64)
    assert cache.snapshot_points(make_request("a", prompt=prompt)) == [64]
    assert reuse_of(cache, prompt) == (0, 63, 63)  # exact repeat: lookup one shorter
    assert reuse_of(cache, [*prompt, 1]) == (64, 64, 64)
    assert reuse_of(cache, prompt[:1]) == (0, 0, 0)
    opted_out = make_request("b", prompt=[*prompt, 1], prompt_logprobs=0)
    assert cache.find_reuse(opted_out).num_tokens == 0
