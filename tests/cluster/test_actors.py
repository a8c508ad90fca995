"""The router actor's feed (cluster/actors.py RouteSession, through cluster/handles.py
RemoteRouter): routes and releases over loopback TCP against the actor's own class, run in
process; oracle: the router's load, which every route raises and every release gives back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from hybridserve.cluster.actors import RouterActor
from hybridserve.cluster.handles import RemoteRouter
from hybridserve.cluster.token_feed import EngineFeed

PROMPT = list(range(1, 41))


def router_actor(max_queued_requests: int | None = None) -> Any:
    """The RouterActor class itself, outside Ray: one prefill and one decode engine (two
    sequences)."""
    return RouterActor.__ray_actor_class__(
        {}, ["prefill-0"], {"decode-0": 2}, 16, False, max_queued_requests, host="127.0.0.1"
    )


def router_handle(actor: Any) -> Any:
    """The actor as its feed's callers reach it over Ray: `subscribe` and `describe`."""

    async def describe() -> dict[str, Any]:
        return actor.describe()

    return SimpleNamespace(
        subscribe=SimpleNamespace(remote=actor.subscribe), describe=SimpleNamespace(remote=describe)
    )


def remote_router(actor: Any) -> RemoteRouter:
    """A replica's RemoteRouter, its feed opened with a ticket from the actor's `subscribe`."""
    return RemoteRouter(EngineFeed("router", router_handle(actor)))


async def settled(actor: Any) -> dict[str, int]:
    """The router's load once the releases sent without waiting have landed."""
    for _ in range(100):
        await asyncio.sleep(0.01)
        if not any(actor.stats()["load"].values()):
            break
    return actor.stats()["load"]


def test_routes_and_releases_travel_on_the_router_s_feed():
    async def scenario() -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
        actor = router_actor()
        router = remote_router(actor)
        route = await router.route(PROMPT, None)
        held = dict(actor.stats()["load"])
        for engine in route["incarnations"]:
            await router.release(engine)
        released = await settled(actor)
        actor.feeds.close()
        return route, held, released

    route, held, released = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert (route["prefill"], route["decode"]) == ("prefill-0", "decode-0")
    assert held == {"prefill-0": 1, "decode-0": 1}
    assert not any(released.values())


def test_a_refusal_comes_back_as_the_route():
    async def scenario() -> list[dict[str, Any]]:
        actor = router_actor(max_queued_requests=0)
        router = remote_router(actor)
        routes = [await router.route(PROMPT, None) for _ in range(3)]
        actor.feeds.close()
        return routes

    *admitted, refused = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert all("decode" in route for route in admitted)
    assert refused["refused"]["status"] == 429


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
