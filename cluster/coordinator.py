"""The Coordinator: owns the engine actors and the router actor of one service.

A Ray Serve deployment with one replica. It starts the router first (so no cache event is
lost), then every engine, and hands their handles to the ingress replicas. Serve calls its
`check_health` periodically: an engine that stopped answering is dropped from the router
(its index entries go with it) and reported in the log; the service stays healthy while at
least one decode engine is alive. On shutdown it drains the engines.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray import serve

from hybridserve.cluster.actors import EngineActor, RouterActor
from hybridserve.cluster.config import ServiceConfig

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0


@serve.deployment(num_replicas=1, health_check_period_s=5, health_check_timeout_s=30)
class Coordinator:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = ServiceConfig(**config)
        names = self.config.engine_names()
        prefill = [n for n, role in names.items() if role == "prefill"]
        decode = [n for n, role in names.items() if role != "prefill"]
        first = self.config.engine_config(self.config.roles()[0])
        self.router = RouterActor.remote(
            self.config.router.model_dump(),
            prefill,
            decode,
            first.block_size,
            first.enable_partial_reuse,
        )
        self.engines = {
            name: EngineActor.options(**self.config.engine_actor_options).remote(
                name,
                self.config.engine_config(role).model_dump(),
                self.router,
                torch_threads=self.config.torch_threads,
                transfer_timeout=self.config.transfer_timeout_s,
            )
            for name, role in names.items()
        }
        self.roles = names
        # Engines load their model in parallel; wait for all before taking traffic.
        described = ray.get([engine.describe.remote() for engine in self.engines.values()])
        self.model_info = {
            "model_id": self.config.model_id,
            "vocab_size": described[0]["vocab_size"],
            "max_model_len": min(d["max_model_len"] for d in described),
        }
        self.dead: set[str] = set()
        logger.info("service ready: %s", ", ".join(f"{n} ({r})" for n, r in names.items()))

    def topology(self) -> dict[str, Any]:
        """What an ingress replica needs: the router, live engines, the model's limits."""
        live = {n: h for n, h in self.engines.items() if n not in self.dead}
        return {"router": self.router, "engines": live, "model": self.model_info}

    async def mark_dead(self, name: str) -> None:
        """An ingress saw `name` fail: stop routing to it."""
        if name in self.engines and name not in self.dead:
            self.dead.add(name)
            await self.router.remove_engine.remote(name)
            logger.error("engine %s is dead: removed from routing and the prefix index", name)

    async def check_health(self) -> None:
        for name, engine in self.engines.items():
            if name in self.dead:
                continue
            try:
                await asyncio.wait_for(engine.describe.remote(), HEALTH_TIMEOUT_S)
            except Exception as exc:  # a dead actor, a timeout: the engine is gone for us
                logger.error("engine %s failed its health check: %s", name, exc)
                await self.mark_dead(name)
        if all(n in self.dead for n, role in self.roles.items() if role != "prefill"):
            raise RuntimeError("no decode engine is alive")

    async def healthy(self) -> bool:
        return any(n not in self.dead for n, role in self.roles.items() if role != "prefill")

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
        timeout = self.config.drain_timeout_s
        live = [h for n, h in self.engines.items() if n not in self.dead]
        results = await asyncio.gather(
            *(h.drain.remote(timeout) for h in live), return_exceptions=True
        )
        cut = sum(r for r in results if isinstance(r, int))
        if cut:
            logger.warning("shutdown cut off %d running requests", cut)
        await asyncio.gather(*(h.shutdown.remote() for h in live), return_exceptions=True)
