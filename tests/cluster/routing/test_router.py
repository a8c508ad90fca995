"""The router's admission arithmetic: requests beyond the decode engines' sequence slots queue,
up to `max_queued_requests`; the next is refused (429) until one finishes; with no decode
engine alive every request is refused (503). And what each policy chooses on one index; routing
through the service is covered by the service tests."""

from __future__ import annotations

import pytest

from hybridserve.cluster.routing.prefix_index import PrefixIndex, prompt_chain
from hybridserve.cluster.routing.router import Router, RouterConfig, RouteRefused
from hybridserve.workers.cache.events import BlockStored, SnapshotStored


def make_router(max_queued: int | None, capacities: dict[str, int] | None = None) -> Router:
    capacities = capacities or {"decode-0": 2, "decode-1": 2}
    index = PrefixIndex(4, partial_reuse=False)
    return Router(RouterConfig(), index, ["prefill-0"], capacities, max_queued)


def admit(router: Router, n: int) -> list[str]:
    return [router.route(prompt_chain([1, 2, 3, i], None, 4)).decode for i in range(n)]


def test_requests_queue_up_to_the_limit_then_get_429_until_one_finishes():
    router = make_router(max_queued=3)
    decodes = admit(router, 7)  # 4 run (2 slots on each of 2 engines), 3 queue
    assert router.num_queued() == 3
    with pytest.raises(RouteRefused) as refused:
        admit(router, 1)
    assert refused.value.status == 429
    assert "3 requests are queued (max_queued_requests=3)" in refused.value.message
    assert router.num_queued() == 3  # a refusal counts nowhere
    router.release(decodes[0])
    assert admit(router, 1)  # room again
    with pytest.raises(RouteRefused):
        admit(router, 1)


def test_a_limit_of_zero_admits_exactly_what_runs_at_once():
    router = make_router(max_queued=0)
    admit(router, 4)
    with pytest.raises(RouteRefused):
        admit(router, 1)


def test_without_a_limit_nothing_is_refused():
    router = make_router(max_queued=None)
    admit(router, 100)
    assert router.num_queued() == 96


def test_a_dead_decode_engine_takes_its_slots_with_it():
    router = make_router(max_queued=1)
    admit(router, 3)
    router.remove_engine("decode-1")  # 2 slots left, and what ran there is gone
    assert router.num_queued() == 0
    admit(router, 1)  # decode-0: 3 in flight for 2 slots, one queued
    with pytest.raises(RouteRefused):
        admit(router, 1)
    router.remove_engine("decode-0")
    with pytest.raises(RouteRefused) as refused:
        admit(router, 1)
    assert refused.value.status == 503


def test_each_policy_picks_by_what_it_scores():
    """Engine a holds two blocks of the prompt with a snapshot after the second (8 tokens
    reusable); engine b holds three blocks with a snapshot after the first only (12 tokens of
    attention, 4 reusable); engine c holds nothing. Colocated, a request in flight on a and on
    b, load weighing 1 token a request."""
    tokens = list(range(1, 14))  # lookup: 12 tokens, three full blocks of 4
    prompt = prompt_chain(tokens, None, 4)
    k1, k2, k3 = prompt.chain[1:]
    root = prompt.chain[0]
    stored = [BlockStored(k1, root, 4), BlockStored(k2, k1, 4), BlockStored(k3, k2, 4)]
    routes = {}
    for policy in ("snapshot-aware", "attention-only", "least-load", "round-robin"):
        config = RouterConfig(policy=policy, load_cost_tokens=1)
        router = Router(config, PrefixIndex(4), [], {"a": 8, "b": 8, "c": 8})
        router.index.apply("a", [*stored[:2], SnapshotStored(k2, 4)])
        router.index.apply("b", [*stored, SnapshotStored(k1, 4)])
        for loaded in ("a", "b"):  # one request in flight on each
            router.decode.change(loaded, +1)
        route = router.route(prompt)
        routes[policy] = (route.decode, route.expected_cached_tokens)
    assert routes == {
        "snapshot-aware": ("a", 8),  # 8 - 1 > 4 - 1
        "attention-only": ("b", 12),  # by the attention match, whatever b can reuse (4)
        "least-load": ("c", 0),  # the one with nothing in flight
        "round-robin": ("a", 0),  # turn 0
    }
