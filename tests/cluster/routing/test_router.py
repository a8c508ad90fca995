"""The router's admission arithmetic: requests beyond the decode engines' sequence slots queue,
up to `max_queued_requests`; the next is refused (429) until one finishes; with no decode
engine alive every request is refused (503). Routing itself is covered by the service tests."""

from __future__ import annotations

import pytest

from hybridserve.cluster.routing.prefix_index import PrefixIndex, prompt_chain
from hybridserve.cluster.routing.router import Router, RouterConfig, RouteRefused


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
