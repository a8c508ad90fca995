"""An ingress replica's link to the running service: the `Service` the OpenAI routes use
(cluster/openai/routes.py).

It keeps the topology the Coordinator hands out (engine handles, their incarnations and
transfer addresses, the router, the served model), one token feed per engine incarnation and
one to the router (cluster/transport/token_feed.py), reports an engine that died, and runs
each request through the orchestrator (cluster/orchestrator.py). A topology taken before an
engine restarted is stale: the request is routed again on a fresh one.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from hybridserve.cluster.control.feed_endpoint import ActorEndpoint
from hybridserve.cluster.messages import GenerateRequest, TokenEvent
from hybridserve.cluster.orchestrator import EngineDied, Orchestrator, StaleTopology
from hybridserve.cluster.transport.handles import RemoteEngine, RemoteRouter
from hybridserve.cluster.transport.token_feed import EngineFeed

ROUTER = "router"  # the router's feed name: its EngineDied carries it


class ServiceClient:
    def __init__(self, coordinator: Any) -> None:
        """`coordinator`: the Coordinator deployment's handle."""
        self.coordinator = coordinator
        self._topology: dict[str, Any] | None = None
        self._feeds: dict[tuple[str, str, int], EngineFeed] = {}  # (epoch, name, incarnation)

    async def _topo(self) -> dict[str, Any]:
        if self._topology is None:
            self._topology = await self.coordinator.topology.remote()
        return self._topology

    async def model(self) -> dict[str, Any]:
        return (await self._topo())["model"]

    async def healthy(self) -> bool:
        return bool(await self.coordinator.healthy.remote())

    async def stats(self) -> dict[str, Any]:
        return await self.coordinator.stats.remote()

    async def events(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """The request's TokenEvents. A route to an engine restarted since this replica took
        its topology (StaleTopology), or through a router that died (EngineDied, raised by
        the route before any event), is retried once on a fresh topology: a dead router is
        reported first, and the Coordinator answers once a new one is in place."""
        for attempt in range(2):
            topology = await self._topo()
            try:
                async for event in self._run(request, topology):
                    yield event
                return
            except StaleTopology:
                if attempt:
                    raise
                self._topology = None
            except EngineDied as dead:
                if attempt or dead.name != ROUTER:
                    raise
                await self._router_died(topology["router_id"])

    async def _run(
        self, request: GenerateRequest, topology: dict[str, Any]
    ) -> AsyncIterator[TokenEvent]:
        epoch, incarnations = topology["epoch"], topology["incarnations"]
        addresses = topology["addresses"]
        engines = {
            name: RemoteEngine(
                name,
                self._feed(epoch, name, incarnations[name], handle),
                (str(addresses[name][0]), int(addresses[name][1])) if addresses[name] else None,
            )
            for name, handle in topology["engines"].items()
        }

        async def engine_died(name: str) -> None:
            await self._engine_died(epoch, name, incarnations.get(name))

        router_feed = self._feed(
            epoch,
            ROUTER,
            topology["router_id"],
            topology["router"],
            functools.partial(self._router_died, topology["router_id"]),
        )
        orchestrator = Orchestrator(
            RemoteRouter(router_feed, topology["block_size"]),
            engines,
            engine_died,
            incarnations,
        )
        async for event in orchestrator.run(request):
            yield event

    async def _engine_died(self, epoch: str, name: str, incarnation: int | None) -> None:
        """Report `name` dead to the Coordinator, which takes it out of routing and restarts
        it. Whoever sees it first reports (the feed, or a request on it; the Coordinator
        acts on the first report). The topology's epoch and the engine's incarnation make a
        report about an engine that has been restarted since, or that an earlier
        Coordinator started, stale: it cannot take the new one down."""
        try:
            await self.coordinator.mark_dead.remote(name, incarnation, epoch)
        finally:
            self._topology = None  # routed afresh from now on

    async def _router_died(self, router_id: str) -> None:
        """Report the router dead; the Coordinator returns once another is in place."""
        try:
            await self.coordinator.mark_router_dead.remote(router_id)
        finally:
            self._topology = None

    def _feed(
        self,
        epoch: str,
        name: str,
        incarnation: int | str,
        handle: Any,
        on_death: Callable[[], Awaitable[None]] | None = None,
    ) -> EngineFeed:
        """This replica's connection to that engine incarnation, or to the router (one for
        all requests; `incarnation`: its actor id). A feed reports the death of its actor,
        even with no request open on it (an engine's by default)."""
        key = (epoch, name, incarnation)
        feed = self._feeds.get(key)
        if feed is None or feed.dead:
            for old in [k for k, f in self._feeds.items() if k[1] == name and f is not feed]:
                del self._feeds[old]  # earlier incarnations, or a Coordinator's before
            if on_death is None:
                on_death = functools.partial(self._engine_died, epoch, name, incarnation)
            feed = self._feeds[key] = EngineFeed(name, ActorEndpoint(handle), on_death)
        return feed
