"""The `ray` executor: an engine's ranks as Ray actors in one placement group.

    placement group of tp bundles (STRICT_PACK by default: one node)
      bundle 0      the EngineActor: rank 0 (the engine, its scheduler, rank 0's shard)
      bundle 1..    RankActor r: `run_rank` until rank 0 says stop

Start-up, steps and failure handling are `RankGroupExecutor`'s (workers/rank_group.py); this
module only launches and supervises the rank actors. Each rank actor holds its bundle's
resources (one GPU each on GPUs: Ray makes it the actor's only visible device, so every rank
uses device 0 of its own view). The store and the groups listen on rank 0's node address.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridserve.workers.config import EngineConfig
from hybridserve.workers.models.loader import Checkpoint
from hybridserve.workers.rank_group import RankGroupExecutor, run_rank

logger = logging.getLogger(__name__)


@ray.remote
class RankActor:
    """One tensor-parallel rank other than rank 0."""

    def run(self, init: bytes, device_index: int | None) -> None:
        logging.basicConfig(level=logging.WARNING)
        run_rank(init, device_index=device_index, share_cores=False)


def bundle_options(bundle: dict[str, float]) -> dict[str, Any]:
    """Ray actor options that take exactly a bundle's resources."""
    options: dict[str, Any] = {
        "num_cpus": bundle.get("CPU", 0),
        "num_gpus": bundle.get("GPU", 0),
    }
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    if custom:
        options["resources"] = custom
    return options


class RayExecutor(RankGroupExecutor):
    # Each rank has its own bundle's cores: no sharing of one machine's count.
    share_cores = False

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        max_model_len: int,
        *,
        placement_group: PlacementGroup,
        bundle: dict[str, float],
        node_address: str,
    ) -> None:
        self.placement_group = placement_group
        self.bundle = bundle
        self.store_host = node_address
        super().__init__(config, checkpoint, max_model_len)

    def _launch(self, inits: list[bytes]) -> None:
        device_index = 0 if self.bundle.get("GPU") else None
        self.actors = [
            RankActor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
                **bundle_options(self.bundle),
            ).remote()
            for rank in range(1, len(inits) + 1)
        ]
        self._runs = [
            actor.run.remote(init, device_index)
            for actor, init in zip(self.actors, inits, strict=True)
        ]

    def _exited(self, timeout: float) -> int | None:
        done, _ = ray.wait(self._runs, num_returns=1, timeout=timeout)
        return self._runs.index(done[0]) + 1 if done else None

    def _exit_reason(self, rank: int) -> str | None:
        run = self._runs[rank - 1]
        done, _ = ray.wait([run], timeout=0)
        if not done:
            return None
        try:
            ray.get(run)
        except RayActorError as exc:
            return f"its actor died ({type(exc).__name__})"
        except RayTaskError as exc:
            lines = str(exc).strip().splitlines()
            return lines[-1] if lines else type(exc).__name__
        return "it stopped"

    def _stop_ranks(self) -> None:
        for actor in getattr(self, "actors", []):
            ray.kill(actor, no_restart=True)
