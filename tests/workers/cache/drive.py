"""Driving CacheCoordinator as the scheduler does, for the reuse, eviction and host-tier tests:
`allocate` a chunk, advance `num_computed_tokens`, `commit`, and `free` when done, checking
integrity after each step. The lookup lengths of docs/snapshot-reuse.md exclude the prompt's
last token (`find_reuse` drops it itself), so a "lookup of n tokens" is a prompt of n + 1 tokens
here.
"""

from __future__ import annotations

from hybridserve.workers.cache.hashing import block_hash, root_hash
from tests.helpers import make_prefix_cache, make_request, tokens

A = tokens(300)  # request A of the worked example in docs/snapshot-reuse.md section 6
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


def small_cache(**kwargs):
    """Block size 4, 4 blocks, 2 live slots (0, 1); snapshot slots start at 2."""
    return make_prefix_cache(4, 4, **{"snapshots": 4, **kwargs})


def commit_nine(cache, points=(8,)):
    """Prompt 1..9 committed to 8: blocks 0 and 1 cached, free queue [3, 2, 1, 0]."""
    run(cache, make_request("a", prompt=tokens(9)), *points, 9, points=list(points))


def evict_to_host(cache, start=OTHER):
    """An unrelated 16-token request takes every device block, then goes."""
    x = make_request(f"x{start}", prompt=tokens(16, start))
    admit(cache, x, points=[])
    advance(cache, x, 16)
    cache.free(x)
