"""The router actor's feed (cluster/control/actors.py RouteSession, through
cluster/transport/handles.py RemoteRouter): routes and releases over loopback TCP against the
actor's own class, run in process; oracle: the router's load, which every route raises and every
release gives back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from hybridserve.cluster.control.actors import RouterActor
from hybridserve.cluster.control.feed_endpoint import ActorEndpoint
from hybridserve.cluster.messages import Route
from hybridserve.cluster.routing.router import RouteRefused
from hybridserve.cluster.transport.handles import RemoteRouter
from hybridserve.cluster.transport.token_feed import EngineFeed

PROMPT = list(range(1, 41))


def router_actor(max_queued_requests: int | None = None) -> Any:
    """The RouterActor class itself, outside Ray: one prefill and one decode engine (two
    sequences)."""
    return RouterActor.__ray_actor_class__(
        {}, ["prefill-0"], {"decode-0": 2}, 16, False, max_queued_requests, host="127.0.0.1"
    )


def router_endpoint(actor: Any) -> ActorEndpoint:
    """The actor as its feed's callers reach it: the service's endpoint over a handle whose
    `subscribe` and `describe` are the actor's own methods, as Ray would call them."""

    async def describe() -> dict[str, Any]:
        return actor.describe()

    handle = SimpleNamespace(
        subscribe=SimpleNamespace(remote=actor.subscribe), describe=SimpleNamespace(remote=describe)
    )
    return ActorEndpoint(handle)


def remote_router(actor: Any) -> RemoteRouter:
    """A replica's RemoteRouter, its feed opened with a ticket from the actor's `subscribe`."""
    return RemoteRouter(EngineFeed("router", router_endpoint(actor)), actor.index.block_size)


async def settled(actor: Any) -> dict[str, int]:
    """The router's load once the releases sent without waiting have landed."""
    for _ in range(100):
        await asyncio.sleep(0.01)
        if not any(actor.stats()["load"].values()):
            break
    return actor.stats()["load"]


def test_routes_and_releases_travel_on_the_router_s_feed():
    async def scenario() -> tuple[Route, dict[str, int], dict[str, int]]:
        actor = router_actor()
        router = remote_router(actor)
        route = await router.route(PROMPT, None)
        held = dict(actor.stats()["load"])
        for engine in route.engines:
            await router.release(engine)
        released = await settled(actor)
        actor.feeds.close()
        return route, held, released

    route, held, released = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert (route.prefill, route.decode) == ("prefill-0", "decode-0")
    assert held == {"prefill-0": 1, "decode-0": 1}
    assert not any(released.values())


def test_a_refusal_comes_back_as_the_route():
    async def scenario() -> tuple[list[Route], RouteRefused]:
        actor = router_actor(max_queued_requests=0)
        router = remote_router(actor)
        admitted = [await router.route(PROMPT, None) for _ in range(2)]
        with pytest.raises(RouteRefused) as refused:
            await router.route(PROMPT, None)
        actor.feeds.close()
        return admitted, refused.value

    admitted, refused = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert [route.decode for route in admitted] == ["decode-0", "decode-0"]
    assert refused.status == 429


def test_a_route_whose_caller_left_gives_its_load_back_when_it_lands():
    async def scenario() -> dict[str, int]:
        actor = router_actor()
        router = remote_router(actor)
        await router.route(PROMPT, None)  # the feed is open; this route's load stays
        left = asyncio.ensure_future(router.route(PROMPT, None))
        await asyncio.sleep(0)  # sent
        left.cancel()
        await asyncio.sleep(0.1)
        load = dict(actor.stats()["load"])
        actor.feeds.close()
        return load

    # One route held (the first), the cancelled one given back.
    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == {"prefill-0": 1, "decode-0": 1}
