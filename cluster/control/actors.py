"""Thin Ray actors over the plain classes: EngineActor (EngineHost), RouterActor (Router +
PrefixIndex). Only dicts of plain data cross these calls (`cluster/messages.py`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from typing import Any

import ray

from hybridserve.cluster.control.feed_endpoint import ActorEndpoint
from hybridserve.cluster.engine_host.cpu_binding import claim, free_cores, shares_a_pool
from hybridserve.cluster.engine_host.router_events import RouterEvents
from hybridserve.cluster.messages import PromptChain
from hybridserve.cluster.routing.prefix_index import PrefixIndex, ReuseScore, prompt_chain
from hybridserve.cluster.routing.router import Router, RouterConfig, RouteRefused
from hybridserve.cluster.transport.feed_server import FeedServer, FeedSession, TokenOutbox
from hybridserve.cluster.transport.token_feed import EngineFeed
from hybridserve.workers import EngineConfig

logger = logging.getLogger(__name__)

CLEAR_TIMEOUT_S = 30.0  # for the router to apply an engine's cache events after a clear
BIND_TIMEOUT_S = 10.0  # for the stepping thread to bind its team (it does so between steps)


class RouteSession(FeedSession):
    """The router's session with one ingress replica (cluster/transport/feed_server.py): its routes
    and releases; or with an engine: its cache events. On the router actor's loop, one at a time
    like its Ray calls."""

    def __init__(self, router: RouterActor) -> None:
        super().__init__("router")
        self.router = router

    async def _run(self, method: str, args: list[Any]) -> Any:
        match method, args:
            case "route", [prompt]:
                return self.router.route(prompt)
            case "release", [engine]:
                return self.router.release(engine)
            case "events", [engine, incarnation, seq, events]:
                return self.router.apply_events(engine, incarnation, seq, events)
        return await super()._run(method, args)


# NOTE: out of order, so that Ray never holds a caller's later calls back behind one of its
# calls that has not arrived (a gap in Ray's per-caller sequence stalls an in-order actor for
# 30 s, which bursts of requests with client disconnects provoked). Nothing whose order
# matters comes by Ray: cache events come on the engines' feeds, numbered.
@ray.remote(allow_out_of_order_execution=True)
class RouterActor:
    """One per service, one call at a time (an async actor whose methods never await: its
    calls and its feed sessions' run one after the other on its loop). Ingress replicas route
    and release on a connection of their own (`subscribe`): a Ray call took ~1.5 ms on the
    request path. Engines send their cache events the same way
    (cluster/engine_host/router_events.py)."""

    def __init__(
        self,
        config: dict[str, Any],
        prefill_engines: list[str],
        decode_engines: dict[str, int],
        block_size: int,
        partial_reuse: bool,
        max_queued_requests: int | None,
        host: str | None = None,
        incarnations: dict[str, int] | None = None,
    ) -> None:
        """`decode_engines`: name -> max_num_seqs. `host`: where ingress replicas connect
        (default: this node's address). `incarnations`: the engines' (a router started in
        place of a dead one; default 0 each)."""
        self.index = PrefixIndex(block_size, partial_reuse=partial_reuse)
        self.router = Router(
            RouterConfig(**config),
            self.index,
            prefill_engines,
            decode_engines,
            max_queued_requests,
        )
        self.router.incarnations.update(incarnations or {})
        self._next_seq: dict[str, int] = {}  # of each engine's cache event batches
        host = host or ray.util.get_node_ip_address()
        self.feeds = FeedServer("router", host, lambda: RouteSession(self))

    async def subscribe(self, subscriber: str) -> dict[str, Any]:
        """A FeedTicket: where `subscriber` (an ingress replica) routes and releases
        (cluster/transport/token_feed.py)."""
        return (await self.feeds.admit(subscriber)).to_dict()

    def describe(self) -> dict[str, Any]:
        """Answers while the router lives (a broken feed asks)."""
        return {"name": "router"}

    def apply_events(
        self, engine: str, incarnation: int, seq: int, events: list[dict[str, Any]]
    ) -> None:
        """Batch `seq` of an engine's incarnation. The engine sends the next only once this
        one is answered, so none comes early; dropped: batches of an older incarnation (an
        engine that has since died) and one applied already (resent after its connection
        broke, the first having landed)."""
        current = incarnation == self.router.incarnations.get(engine)
        if not current or seq < self._next_seq.get(engine, 0):
            return
        self.index.apply(engine, events)
        self._next_seq[engine] = seq + 1

    def route(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """A Route message for a PromptChain message, or a RouteRefusal when no engine takes
        the request now."""
        try:
            return self.router.route(PromptChain.from_dict(prompt)).to_dict()
        except RouteRefused as refused:
            return refused.to_message().to_dict()

    def release(self, engine: str) -> None:
        self.router.release(engine)

    def remove_engine(self, name: str) -> None:
        self.router.remove_engine(name)
        self._next_seq.pop(name, None)

    def add_engine(self, name: str, capacity: int | None, incarnation: int) -> None:
        """A restarted engine (`capacity` None: a prefill engine); its index starts empty."""
        self.router.add_engine(name, capacity=capacity, incarnation=incarnation)
        self._next_seq.pop(name, None)

    def set_policy(self, policy: str) -> None:
        """Benchmarks compare policies on one deployment (each starts from the same state)."""
        self.router.set_policy(policy)

    def score(self, token_ids: list[int], cache_salt: str | None) -> dict[str, dict[str, Any]]:
        """What each routable engine could reuse of a prompt (zeros included): for tests and
        benchmarks, which hash the prompt here."""
        scores = self.index.scores(prompt_chain(token_ids, cache_salt, self.index.block_size))
        return {
            name: asdict(scores.get(name) or ReuseScore(name, 0, 0)) for name in self.router.engines
        }

    def stats(self) -> dict[str, Any]:
        return asdict(self.index.stats()) | {
            "load": self.router.loads(),
            "num_queued": self.router.num_queued(),
            "engines": self.router.engines,
            "policy": self.router.config.policy,
        }


@ray.remote
class EngineActor:
    """One engine replica. Async actor: request coroutines share its event loop while the
    host's own threads step the engine and move transfers."""

    def __init__(
        self,
        name: str,
        engine_config: dict[str, Any],
        router: Any | None,
        *,
        torch_threads: int | None = None,
        stream_interval: int = 1,
        transfer_timeout: float = 30.0,
        transfer_deadline: float = 60.0,
        transfer_host: str | None = None,
        placement: dict[str, Any] | None = None,
        incarnation: int = 0,
    ) -> None:
        """`placement` ({"group", "bundle"}): a tensor-parallel engine's placement group, whose
        bundle 0 this actor holds; its other ranks become RankActors in the other bundles."""
        import functools

        import torch

        from hybridserve.cluster.control.rank_actors import RayExecutor, RayRankShards
        from hybridserve.cluster.engine_host.host import EngineHost
        from hybridserve.workers.executors.executor import register_executor

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        if torch_threads:
            torch.set_num_threads(torch_threads)
        if placement is not None:
            register_executor(
                "ray",
                functools.partial(
                    RayExecutor,
                    placement_group=placement["group"],
                    bundle=placement["bundle"],
                    node_address=ray.util.get_node_ip_address(),
                ),
            )
        # Prefill engines and ingress replicas on other nodes reach this one at its own node's
        # address.
        host = transfer_host or ray.util.get_node_ip_address()
        self.host = EngineHost(
            name,
            EngineConfig(**engine_config),
            rank_shards=(
                (lambda engine: [RayRankShards(a) for a in engine.executor.actors])
                if placement is not None
                else None
            ),
            stream_interval=stream_interval,
            transfer_timeout=transfer_timeout,
            transfer_deadline=transfer_deadline,
            transfer_host=host,
        )
        # Ingress replicas call it and read its token batches at the same address
        # (cluster/transport/token_feed.py).
        self.feeds = FeedServer(f"engine {name}", host, functools.partial(TokenOutbox, self.host))
        self.incarnation = incarnation
        self.router_events: RouterEvents | None = None
        if router is not None:
            self._send_events_to(router)

    def _send_events_to(self, router: Any) -> None:
        """This engine's cache events go to `router` from now on, what the cache holds first
        (on the actor's event loop: Ray runs an async actor's constructor there too)."""
        if self.router_events is not None:
            self.router_events.close()
        self.router_events = RouterEvents(
            self.host.name,
            self.incarnation,
            lambda: EngineFeed("router", ActorEndpoint(router)),
            asyncio.get_running_loop(),
        )
        self.host.cache_events.add_sink("router", self.router_events.send, self.host.engine)

    async def add_router(self, router: Any) -> None:
        """A router started in place of a dead one: its index is rebuilt from what this
        engine's cache holds, sent first, then the events after it."""
        self._send_events_to(router)

    def describe(self) -> dict[str, Any]:
        return self.host.describe()

    def cpu_placement(self) -> dict[str, Any]:
        """Where this engine runs, for the Coordinator's `cpu_binding` (`EnginePlacement`): its
        node, its OpenMP threads, the cores it may use that no other live process on the node
        has claimed (None: the claims could not be read), whether it can be bound, and the
        cores its compute (the stepping thread) may run on now."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "cpu_threads": self.host.cpu_threads,
            "cpu_cores": free_cores(),
            # Only an engine that computes in this process ("uni": not a tensor-parallel one,
            # nor one whose executor runs its model in hosts); in a container that shares
            # its cores with others, nothing is bound.
            "bindable": self.host.engine.config.executor_backend == "uni" and not shares_a_pool(),
            "team_cores": self.host.team_cores(),
        }

    async def bind_cpus(self, cores: list[int]) -> bool:
        """Claim `cores` on this node and confine this engine's compute (its stepping thread
        and OpenMP team) to them; False, and unbound, where another process claimed one of
        them meanwhile or the team could not be bound."""
        if not claim(cores):
            logger.warning("engine %s: cores %s are taken; unbound", self.host.name, cores)
            return False
        try:  # a stopped engine's stepping thread never gets to it
            bound = await asyncio.wait_for(
                asyncio.wrap_future(self.host.bind_cores(cores)), BIND_TIMEOUT_S
            )
        except TimeoutError:
            bound = False
        if bound:
            logger.info("engine %s: compute bound to cores %s", self.host.name, cores)
        else:
            claim([])  # give them back
        return bound

    def health(self, stall_timeout_s: float | None = None) -> None:
        """Raises if the engine cannot serve any more (one of its ranks failed, or its
        stepping loop is wedged past `stall_timeout_s`)."""
        self.host.health(stall_timeout_s)

    def rank_actors(self) -> list[Any]:
        """The RankActors of a tensor-parallel engine (ranks 1 .. tp-1), for operators and
        fault tests."""
        return list(getattr(self.host.engine.executor, "actors", []))

    def stats(self) -> dict[str, Any]:
        return self.host.stats()

    def check_integrity(self) -> dict[str, Any]:
        return self.host.check_integrity()

    async def clear_cache(self) -> None:
        """Drop every cached block and snapshot; returns once the router has applied the
        removal events (and every batch before them)."""
        self.host.clear_cache()
        if self.router_events is None:
            return
        try:
            await asyncio.wait_for(self.router_events.applied(), CLEAR_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(
                f"engine {self.host.name}: the router did not apply its cache events "
                f"within {CLEAR_TIMEOUT_S:.0f} s"
            ) from None

    async def subscribe(self, subscriber: str) -> dict[str, Any]:
        """A FeedTicket: where `subscriber` (an ingress replica) connects to make its calls
        here (generate, prefill, expect, follow, ...) and to read the token events of its
        requests, one TokenBatch per step (cluster/transport/token_feed.py); when its connection
        closes, whatever it left running here is aborted."""
        return (await self.feeds.admit(subscriber)).to_dict()

    async def abort(self, request_id: str) -> bool:
        """Stop a request by id (an operator's call; the ingress aborts on its feed)."""
        return await self.host.abort(request_id)

    async def drain(self, timeout: float) -> int:
        return await self.host.drain(timeout)

    async def shutdown(self) -> None:
        self.feeds.close()
        self.host.shutdown()
        if self.router_events is not None:
            self.router_events.close()
