"""Cache events: the versioned wire form, and the events a commit emits in order."""

from __future__ import annotations

import msgpack
import pytest

from hybridserve.workers.cache.events import (
    EVENTS_VERSION,
    BlockRemoved,
    BlockStored,
    SnapshotRemoved,
    SnapshotStored,
    event_from_dict,
    event_to_dict,
)
from hybridserve.workers.cache.hashing import block_hash, block_hashes, root_hash
from tests.helpers import make_prefix_cache, make_request, tokens

ROOT = root_hash(None)
KEY = block_hash(ROOT, [1, 2, 3, 4])

EVENTS = [
    BlockStored(KEY, ROOT, 4),
    BlockRemoved(KEY),
    SnapshotStored(KEY, 4),
    SnapshotStored(KEY, 3, block_hash(ROOT, [1, 2, 3])),
    SnapshotRemoved(KEY, 3),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: f"{e.kind}-{EVENTS.index(e)}")
def test_every_event_round_trips_through_msgpack(event):
    data = event_to_dict(event)
    assert (data["v"], data["kind"]) == (EVENTS_VERSION, event.kind)
    back = event_from_dict(msgpack.unpackb(msgpack.packb(data)))
    assert type(back) is type(event)
    assert back == event


def test_wire_form_of_a_stored_block():
    assert event_to_dict(BlockStored(KEY, ROOT, 4)) == {
        "v": 2,
        "kind": "block_stored",
        "block_hash": KEY,
        "parent_hash": ROOT,
        "num_tokens": 4,
    }
    assert event_to_dict(SnapshotRemoved(KEY, 3)) == {
        "v": 2,
        "kind": "snapshot_removed",
        "block_hash": KEY,
        "coverage": 3,
    }


GOOD = {"v": 2, "kind": "snapshot_stored", "block_hash": KEY, "coverage": 3}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (GOOD | {"v": 1}, "cache event version 1 is not 2"),
        (GOOD | {"v": "2"}, "cache event version '2' is not 2"),
        ({k: v for k, v in GOOD.items() if k != "v"}, "cache event version None is not 2"),
        (GOOD | {"kind": "block_evicted"}, "malformed cache event"),
        ({k: v for k, v in GOOD.items() if k != "kind"}, "malformed cache event"),
        ({k: v for k, v in GOOD.items() if k != "coverage"}, "malformed cache event"),
        (GOOD | {"num_tokens": 3}, "malformed cache event"),
    ],
    ids=["older", "string", "no-version", "kind", "no-kind", "missing", "extra"],
)
def test_a_wrong_version_or_shape_is_rejected(data, message):
    with pytest.raises(ValueError, match=message):
        event_from_dict(data)


def chain(prompt, block_size, cache_salt=None):
    """Block keys of every block of `prompt`, the last one possibly partial."""
    keys, parent = [], root_hash(cache_salt)
    for start in range(0, len(prompt), block_size):
        parent = block_hash(parent, prompt[start : start + block_size])
        keys.append(parent)
    return keys


def commit_at(cache, request, position):
    assert cache.allocate(request, position - request.num_computed_tokens) is not None
    request.num_computed_tokens = position
    cache.commit(request)
    cache.check_integrity()


def test_a_commit_stores_each_new_block_then_the_snapshot():
    cache = make_prefix_cache(block_size=4, num_blocks=8)
    request = make_request("a", prompt=tokens(11))
    request.expect_snapshot_points = [8, 10]
    k0, k1, k2 = chain(request.prompt_token_ids[:10], 4)
    cache.allocate(request, 0)
    commit_at(cache, request, 4)  # not a point: nothing published
    assert cache.take_events() == []
    commit_at(cache, request, 8)
    assert cache.take_events() == [
        BlockStored(k0, ROOT, 4),
        BlockStored(k1, k0, 4),
        SnapshotStored(k1, 4),
    ]
    commit_at(cache, request, 10)  # only the new (partial) block, and its snapshot
    assert cache.take_events() == [BlockStored(k2, k1, 2), SnapshotStored(k2, 2)]
    commit_at(cache, request, 11)  # past the last point: nothing
    assert cache.take_events() == []


def test_events_survive_the_wire_in_order():
    cache = make_prefix_cache(block_size=4, num_blocks=8)
    request = make_request("a", prompt=tokens(11))
    request.expect_snapshot_points = [10]
    cache.allocate(request, 0)
    commit_at(cache, request, 10)
    events = cache.take_events()
    assert [e.kind for e in events] == ["block_stored"] * 3 + ["snapshot_stored"]
    wire = msgpack.packb([event_to_dict(e) for e in events])
    assert [event_from_dict(d) for d in msgpack.unpackb(wire)] == events


@pytest.mark.parametrize("cache_salt", [None, "tenant-a"])
def test_block_hashes_are_the_keys_of_committed_blocks(cache_salt):
    cache = make_prefix_cache(block_size=32, num_blocks=16, interval=128)
    request = make_request("a", prompt=tokens(300))
    request.cache_salt = cache_salt
    request.expect_snapshot_points = cache.snapshot_points(request)
    cache.allocate(request, 0)
    for position in (128, 256, 300):
        commit_at(cache, request, position)
    stored = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    full_keys = block_hashes(request.prompt_token_ids, 32, cache_salt)
    assert len(full_keys) == 9  # 288 tokens; block 9 holds only 12
    nodes = sorted(cache.tree.nodes(), key=lambda n: n.ordinal)
    assert [n.key for n in nodes if n.is_full] == full_keys
    assert [e.block_hash for e in stored] == [
        *full_keys,
        block_hash(full_keys[-1], tokens(12, 289)),
    ]
    assert [e.parent_hash for e in stored] == [root_hash(cache_salt), *full_keys]
    assert [e.num_tokens for e in stored] == [32] * 9 + [12]
    # Another reuse scope hashes the same tokens to different keys.
    other = block_hashes(request.prompt_token_ids, 32, "tenant-b")
    assert set(other).isdisjoint(full_keys)
