"""The Coordinator: owns the engine actors and the router actor of one service.

A Ray Serve deployment with one replica. It starts the router first (so no cache event is
lost), then every engine, and hands their handles to the ingress replicas. An engine with
`tensor_parallel_size` > 1 gets a placement group of one bundle per rank (`rank_resources`,
`placement_strategy`): its EngineActor holds bundle 0 and starts the other ranks in the rest.
Serve calls `check_health` periodically (and /health asks at once): an engine that stopped
answering, whose ranks failed or whose stepping loop is wedged is dropped from the router (its
index entries go with it), its actors are killed or its placement group removed, and it is
restarted after a backoff (`max_engine_restarts`, `engine_restart_backoff_s`, doubling per
attempt) as a new incarnation under the same name, with an empty index. A router that died is
replaced at once, its index rebuilt from what each live engine's cache holds
(`mark_router_dead`). The service stays healthy while at least one decode engine is alive. On
shutdown it drains the engines, then removes their placement groups. Once the engines are up
(and as each restarts) it binds the CPU engines of each node to cores of their own where they
fit (`cpu_binding`, cluster/engine_host/cpu_binding.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import uuid
from typing import Any

import ray
from ray import serve
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridserve.cluster.config import ServiceConfig, cpu_wait
from hybridserve.cluster.control.actors import EngineActor, RouterActor
from hybridserve.cluster.control.placement import check_placeable
from hybridserve.cluster.control.rank_actors import bundle_options
from hybridserve.cluster.engine_host.cpu_binding import EnginePlacement, assign_cores, node_cores
from hybridserve.transceiver.auth import new_secret
from hybridserve.workers import EngineConfig

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0  # an engine's actor answers health() on its event loop, at once


# NOTE: one constructor attempt: what fails it (a placement the cluster cannot hold, a
# checkpoint that does not load) fails again, and Serve would retry it without end.
@serve.deployment(
    num_replicas=1,
    health_check_period_s=5,
    health_check_timeout_s=30,
    max_constructor_retry_count=1,
)
class Coordinator:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = ServiceConfig(**config)
        # What shutdown reads, set before anything can fail: a start that fails halfway
        # shuts down what it started.
        self.engines: dict[str, Any] = {}
        self.dead: set[str] = set()
        self.placement_groups: dict[str, PlacementGroup] = {}
        self._restarting: dict[str, asyncio.Task[None]] = {}
        self.router: Any = None
        self.router_id = ""  # the router actor's id: reports about an older one are stale
        self.router_restarts = 0
        self._router_lock = asyncio.Lock()
        try:
            self._start()
        except BaseException:
            self._stop_started()
            raise

    def _start(self) -> None:
        names = self.config.engine_names()
        self._check_placeable(names)
        prefill = [n for n, role in names.items() if role == "prefill"]
        decode = {
            n: self.config.engine_config(role).max_num_seqs
            for n, role in names.items()
            if role != "prefill"
        }
        self.router = self._new_router(prefill, decode, {})
        self.resources: dict[str, dict[str, Any]] = {}
        # The deployment's transfer secret: its engines' links admit only each other.
        self.transfer_secret = new_secret()
        # Which Coordinator this is: when Serve restarts it, its engines (and their
        # incarnation numbers) start afresh, and reports about the old ones must not match.
        self.epoch = uuid.uuid4().hex
        self._choose_engine_env()
        for name, role in names.items():
            self.engines[name] = self._start_engine(name, self.config.engine_config(role))
        self.roles = names
        # Engines load their model in parallel; wait for all before taking traffic.
        described = ray.get([engine.describe.remote() for engine in self.engines.values()])
        # Where each decode engine takes transfers (None: not a decode engine).
        self.addresses = {
            name: d["address"] for name, d in zip(self.engines, described, strict=True)
        }
        self.model_info = {
            "model_id": self.config.model_id,
            "vocab_size": described[0]["vocab_size"],
            "eos_token_ids": described[0]["eos_token_ids"],
            "max_model_len": min(d["max_model_len"] for d in described),
        }
        # Where each CPU engine runs, and the cores it is bound to (None: unbound).
        self.placements: dict[str, EnginePlacement] = {}
        self.cpu_bindings: dict[str, tuple[int, ...] | None] = {}
        try:
            self._bind_cores(list(self.engines))
        except Exception as exc:  # an optimisation: never a reason not to serve
            logger.warning("CPU binding skipped: %r", exc)
        # A restarted engine is a new incarnation under its old name; reports about an older
        # one are stale (mark_dead ignores them).
        self.incarnations = dict.fromkeys(self.engines, 0)
        self.restarts: dict[str, int] = dict.fromkeys(self.engines, 0)
        logger.info("service ready: %s", ", ".join(f"{n} ({r})" for n, r in names.items()))

    def _new_router(
        self, prefill: list[str], decode: dict[str, int], incarnations: dict[str, int]
    ) -> Any:
        """A RouterActor over these engines (decode: name -> max_num_seqs), its index empty."""
        first = self.config.engine_config(self.config.roles()[0])
        router = RouterActor.remote(
            self.config.router.model_dump(),
            prefill,
            decode,
            first.block_size,
            first.enable_partial_reuse,
            self.config.max_queued_requests,
            self.config.transfer_host,
            incarnations,
        )
        self.router_id = router._actor_id.hex()
        return router

    def _check_placeable(self, names: dict[str, Any]) -> None:
        """Refuse at once a service whose engines the cluster's nodes cannot hold even empty
        (placement_check "now"), naming what is missing."""
        if self.config.placement_check != "now":
            return
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        nodes = {
            f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})": node["Resources"]
            for node in ray.nodes()
            if node["Alive"]
        }
        strategies = {
            name: self.config.placement_strategy
            for name, role in names.items()
            if self.config.engine_config(role).tensor_parallel_size > 1
        }
        check_placeable(self.config.resource_demand(cluster_gpus), strategies, nodes)

    def _stop_started(self) -> None:
        """After a failed start: what was started goes (the engines, their placement groups,
        the router)."""
        for handle in self.engines.values():
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        for group in self.placement_groups.values():
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        if self.router is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.router, no_restart=True)
        self.engines, self.placement_groups, self.router = {}, {}, None

    def _start_engine(self, name: str, engine: EngineConfig, incarnation: int = 0) -> Any:
        """The engine's actor; a tensor-parallel engine's first in its own placement group."""
        kwargs: dict[str, Any] = {
            "torch_threads": self.config.threads(engine.role),
            "stream_interval": self.config.stream_interval,
            "transfer_timeout": self.config.transfer_timeout_s,
            "transfer_deadline": self.config.transfer_deadline_s,
            "transfer_host": self.config.transfer_host,
            "incarnation": incarnation,
        }
        tp = engine.tensor_parallel_size
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        if tp == 1:
            options = self.config.single_rank_options(engine.role, cluster_gpus)
            self.resources[name] = {"ranks": 1, "actor_options": options}
            return EngineActor.options(**self._with_engine_env(options)).remote(
                name, self._engine_fields(engine), self.router, **kwargs
            )
        bundle = self.config.rank_bundle(engine.role, cluster_gpus)
        group = placement_group([bundle] * tp, strategy=self.config.placement_strategy)
        timeout = self.config.placement_timeout_s
        try:
            ray.get(group.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(
                f"engine {name} needs {tp} bundles of {bundle} ({self.config.placement_strategy})"
                f" and the cluster could not place them within placement_timeout_s={timeout:g} "
                "s: their resources are taken"
            ) from None
        self.placement_groups[name] = group
        self.resources[name] = {
            "ranks": tp,
            "bundle": bundle,
            "placement_strategy": self.config.placement_strategy,
        }
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        kwargs["placement"] = {"group": group, "bundle": bundle}
        options = self._with_engine_env(bundle_options(bundle))
        return EngineActor.options(**options, scheduling_strategy=strategy).remote(
            name, self._engine_fields(engine), self.router, **kwargs
        )

    def _choose_engine_env(self) -> None:
        """Set `engine_env`, the variables the engines get on top of what they inherit (the
        node's environment, the application's runtime environment, `engine_actor_options`),
        for this node; and `engine_wait`, how their threads wait then. OpenMP reads these
        variables once, as a process starts."""
        num_cores = node_cores()
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        inherited = self.config.inherited_env(os.environ)
        self.engine_env = self.config.engine_env(num_cores, cluster_gpus, inherited)
        self.engine_wait = cpu_wait(inherited | self.engine_env)
        if self.config.teams_share_cores(num_cores, cluster_gpus):
            logger.warning(
                "the CPU engines take %d threads on this node's %d cores, in several teams; "
                "their threads wait: %s (cpu_wait_policy=%s); fewer torch_threads, so that "
                "each has a core, is faster",
                sum(self.config.cpu_engine_threads(cluster_gpus)),
                num_cores,
                self.engine_wait,
                self.config.cpu_wait_policy,
            )

    def _bind_cores(self, names: list[str]) -> None:
        """Bind the CPU engines among `names` (just started) to cores of their own where
        their nodes' engines fit (`cpu_binding`, cluster/engine_host/cpu_binding.py); the others run
        unbound. Blocks on the engines' answers."""
        if self.config.cpu_binding == "off":
            return
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        cpu_engines = [
            name for name in names if not self.config.on_gpu(self.roles[name], cluster_gpus)
        ]
        reported = ray.get([self.engines[name].cpu_placement.remote() for name in cpu_engines])
        placing = [
            EnginePlacement(
                name,
                r["node_id"],
                r["cpu_threads"] or 0,
                tuple(r["cpu_cores"] or ()),
                # Unknown threads (no OpenMP runtime) or unreadable claims: not bindable.
                bindable=r["bindable"] and bool(r["cpu_threads"]) and r["cpu_cores"] is not None,
            )
            for name, r in zip(cpu_engines, reported, strict=True)
        ]
        others = [e for name, e in self.placements.items() if name not in names]
        assigned = assign_cores(placing, others, self.cpu_bindings)
        self.placements.update((e.name, e) for e in placing)
        self.cpu_bindings.update(assigned)
        chosen = {name: cores for name, cores in assigned.items() if cores is not None}
        bound = ray.get([self.engines[n].bind_cpus.remote(list(c)) for n, c in chosen.items()])
        for name, ok in zip(chosen, bound, strict=True):
            if not ok:
                self.cpu_bindings[name] = None
        unbound = [name for name in assigned if self.cpu_bindings[name] is None]
        if unbound:
            logger.info(
                "engines %s: not bound to cores (their node's CPU engines need more threads "
                "than it has cores, one of them cannot be bound, or the cores were taken)",
                ", ".join(unbound),
            )

    def cpu_placements(self) -> list[dict[str, Any]]:
        """Where each CPU engine said it runs when it was placed (`EnginePlacement`)."""
        return [dataclasses.asdict(placement) for placement in self.placements.values()]

    def cpu_binding(self) -> dict[str, list[int] | None]:
        """The cores each CPU engine is bound to (None: unbound; benchmark records)."""
        return {n: None if c is None else list(c) for n, c in self.cpu_bindings.items()}

    def _with_engine_env(self, options: dict[str, Any]) -> dict[str, Any]:
        """An engine actor's `options` with the engines' variables in its runtime
        environment (the options' own variables win; Ray merges the result with what the
        actor inherits, and its rank actors inherit it in turn)."""
        if not self.engine_env:
            return options
        own = dict(options.get("runtime_env") or {})
        env_vars = self.engine_env | dict(own.get("env_vars") or {})
        return options | {"runtime_env": own | {"env_vars": env_vars}}

    def _engine_fields(self, engine: EngineConfig) -> dict[str, Any]:
        return engine.model_dump() | {"transfer_secret": self.transfer_secret}

    def topology(self) -> dict[str, Any]:
        """What an ingress replica needs: the router, live engines, the model's limits."""
        live = {n: h for n, h in self.engines.items() if n not in self.dead}
        return {
            "router": self.router,
            "router_id": self.router_id,
            "engines": live,
            "incarnations": {n: self.incarnations[n] for n in live},
            "addresses": {n: self.addresses[n] for n in live},
            "epoch": self.epoch,
            "model": self.model_info,
            # The router's block chain, which replicas hash each prompt into.
            "block_size": self.config.engine_config(self.config.roles()[0]).block_size,
        }

    async def mark_dead(
        self, name: str, incarnation: int | None = None, epoch: str | None = None
    ) -> None:
        """`name` failed (an ingress saw it die, or it failed a health check): stop routing
        to it, make sure its actors are gone, and restart it. A report about an incarnation
        that has been restarted since, or about an engine of an earlier Coordinator (`epoch`
        of the topology it came from), is ignored."""
        if name not in self.engines or name in self.dead:
            return
        if incarnation is not None and incarnation != self.incarnations[name]:
            return
        if epoch is not None and epoch != self.epoch:
            return
        async with self._router_lock:  # a router being replaced sees it dead, or is told
            self.dead.add(name)
            await self._tell_router("remove_engine", name)
        logger.error("engine %s is dead: removed from routing and the prefix index", name)
        group = self.placement_groups.pop(name, None)
        if group is not None:
            remove_placement_group(group)  # its rank actors (and its engine actor) go
        else:  # dead, or alive but wedged: either way it must not linger
            with contextlib.suppress(Exception):
                ray.kill(self.engines[name], no_restart=True)
        self._schedule_restart(name)

    def _schedule_restart(self, name: str) -> None:
        attempt = self.restarts[name] + 1
        if attempt > self.config.max_engine_restarts:
            logger.error(
                "engine %s stays down: max_engine_restarts=%d reached",
                name,
                self.config.max_engine_restarts,
            )
            return
        self.restarts[name] = attempt
        self._restarting[name] = asyncio.get_running_loop().create_task(
            self._restart(name, attempt)
        )

    async def _restart(self, name: str, attempt: int) -> None:
        """Start `name` afresh after a backoff (doubling per attempt); it rejoins routing with
        an empty prefix index once its model has loaded."""
        delay = self.config.engine_restart_backoff_s * 2 ** (attempt - 1)
        await asyncio.sleep(delay)
        role = self.roles[name]
        engine = self.config.engine_config(role)
        incarnation = self.incarnations[name] + 1
        router_id = self.router_id  # the router the engine starts sending its events to
        try:
            handle = await asyncio.to_thread(self._start_engine, name, engine, incarnation)
            described = await handle.describe.remote()
        except Exception as exc:
            logger.error("engine %s: restart %d failed: %r", name, attempt, exc)
            group = self.placement_groups.pop(name, None)
            if group is not None:
                remove_placement_group(group)
            self._schedule_restart(name)
            return
        self.engines[name] = handle
        self.addresses[name] = described["address"]
        self.incarnations[name] = incarnation
        capacity = None if role == "prefill" else engine.max_num_seqs
        async with self._router_lock:
            await self._tell_router("add_engine", name, capacity, incarnation)
            if router_id != self.router_id:  # replaced while the engine started
                await handle.add_router.remote(self.router)
            self.dead.discard(name)
        logger.info("engine %s restarted (attempt %d, after %.1f s)", name, attempt, delay)
        try:
            await asyncio.to_thread(self._bind_cores, [name])
        except Exception as exc:  # an optimisation: it serves unbound
            logger.warning("engine %s: CPU binding skipped: %r", name, exc)

    async def _tell_router(self, method: str, *args: Any) -> None:
        """A change of the engines, for the router; a dead router misses nothing by it: the
        one that replaces it starts from the engines as they are then."""
        try:
            await getattr(self.router, method).remote(*args)
        except ray.exceptions.RayActorError as exc:
            logger.error("the router is gone (%r); it is restarted", exc)

    async def mark_router_dead(self, router_id: str) -> None:
        """The router `router_id` died (an ingress replica's connection to it ended with the
        actor gone, or it failed a health check): a new one takes its place, told which
        engines are alive, and each live engine sends it what its cache holds before any
        later event, so its index is rebuilt. Ingress replicas route through it once they
        refresh their topology. Returns once it is in place; a report about a router that
        has been replaced already is ignored. Requests in flight keep the load the old
        router counted for them out of the new one's count until they end."""
        async with self._router_lock:
            if router_id != self.router_id:
                return
            with contextlib.suppress(Exception):
                ray.kill(self.router, no_restart=True)
            live = [n for n in self.engines if n not in self.dead]
            prefill = [n for n in live if self.roles[n] == "prefill"]
            decode = {
                n: self.config.engine_config(self.roles[n]).max_num_seqs
                for n in live
                if self.roles[n] != "prefill"
            }
            self.router = self._new_router(prefill, decode, {n: self.incarnations[n] for n in live})
            await self.router.describe.remote()  # up before anyone probes it
            self.router_restarts += 1
            results = await asyncio.gather(
                *(self.engines[n].add_router.remote(self.router) for n in live),
                return_exceptions=True,
            )
            for name, result in zip(live, results, strict=True):
                if isinstance(result, BaseException):  # its own health check takes it out
                    logger.error("engine %s: could not join the new router: %r", name, result)
            logger.warning("router restarted (%d so far); its index rebuilt", self.router_restarts)

    async def _probe_router(self) -> None:
        async with self._router_lock:  # never one still starting
            router, router_id = self.router, self.router_id
        try:
            await asyncio.wait_for(router.describe.remote(), HEALTH_TIMEOUT_S)
        except Exception as exc:
            logger.error("the router failed its health check: %r", exc)
            await self.mark_router_dead(router_id)

    async def check_health(self) -> None:
        await self._probe_router()
        await self._probe_engines()
        if not self._serving():
            raise RuntimeError("no decode engine is alive")

    async def healthy(self) -> bool:
        """/health: whether a decode engine can serve now. Every live engine is asked at
        once (its stepping loop's heartbeat, not only whether its actor answers), so a
        wedged or dead engine turns this false within one probe and leaves routing."""
        await asyncio.gather(self._probe_router(), self._probe_engines())
        return self._serving()

    def _serving(self) -> bool:
        return any(n not in self.dead for n, role in self.roles.items() if role != "prefill")

    async def _probe_engines(self) -> None:
        live = [(n, h) for n, h in self.engines.items() if n not in self.dead]
        stall = self.config.engine_stall_timeout_s
        results = await asyncio.gather(
            *(asyncio.wait_for(h.health.remote(stall), HEALTH_TIMEOUT_S) for _, h in live),
            return_exceptions=True,
        )
        for (name, _), result in zip(live, results, strict=True):
            if isinstance(result, BaseException):  # dead actor or rank, wedged, no answer
                logger.error("engine %s failed its health check: %r", name, result)
                await self.mark_dead(name)

    def engine_resources(self) -> dict[str, dict[str, Any]]:
        """What each engine got: its ranks and each rank's resources (benchmark records)."""
        return self.resources

    def cpu_wait_policy(self) -> str:
        """How the engines' CPU threads wait: "passive", "brief" or "active" (benchmark
        records)."""
        return self.engine_wait

    async def stats(self) -> dict[str, Any]:
        """Per-engine figures and the index size, for /metrics."""
        live = {n: h for n, h in self.engines.items() if n not in self.dead}
        results = await asyncio.gather(
            *(h.stats.remote() for h in live.values()), return_exceptions=True
        )
        engines = {n: r for n, r in zip(live, results, strict=True) if isinstance(r, dict)}
        return {"engines": engines, "router": await self.router.stats.remote()}

    async def set_policy(self, policy: str) -> None:
        await self.router.set_policy.remote(policy)

    async def clear_caches(self) -> None:
        """Benchmarks start each policy cold."""
        await asyncio.gather(
            *(h.clear_cache.remote() for n, h in self.engines.items() if n not in self.dead)
        )

    async def __del__(self) -> None:
        for task in self._restarting.values():
            task.cancel()
        timeout = self.config.drain_timeout_s
        live = [h for n, h in self.engines.items() if n not in self.dead]
        results = await asyncio.gather(
            *(h.drain.remote(timeout) for h in live), return_exceptions=True
        )
        cut = sum(r for r in results if isinstance(r, int))
        if cut:
            logger.warning("shutdown cut off %d running requests", cut)
        await asyncio.gather(*(h.shutdown.remote() for h in live), return_exceptions=True)
        for group in self.placement_groups.values():
            remove_placement_group(group)
