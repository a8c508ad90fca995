"""The `ray` executor: an engine's ranks as Ray actors in one placement group.

    placement group of tp bundles (STRICT_PACK by default: one node)
      bundle 0      the EngineActor: rank 0 (the engine, its scheduler, rank 0's shard)
      bundle 1..    RankActor r: `run_rank` until rank 0 says stop

Start-up, steps and failure handling are `RankGroupExecutor`'s (workers/executors/rank_group.py);
this module only launches and supervises the rank actors. Each rank actor holds its bundle's
resources (one GPU each on GPUs: Ray makes it the actor's only visible device, so every rank
uses device 0 of its own view). The store and the groups listen on rank 0's node address. In
a disaggregated engine each rank actor also holds its own shard links (transceiver/shards.py),
which its rank 0 drives through `RayRankShards`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridserve.transceiver.base import Pools
from hybridserve.transceiver.channel import TransferFailed
from hybridserve.transceiver.layout import PeerLayout
from hybridserve.transceiver.protocol import ReceivePlan, from_dict, to_dict
from hybridserve.transceiver.registry import create_backend
from hybridserve.transceiver.shards import RankShards, ShardReceiver, ShardSender
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.disaggregation.layout import peer_layout
from hybridserve.workers.executors.rank_group import RankGroupExecutor, run_rank
from hybridserve.workers.models.loader import Checkpoint
from hybridserve.workers.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


# `run` holds one thread for the rank's whole life; transfer calls run on the others.
@ray.remote(max_concurrency=8)
class RankActor:
    """One tensor-parallel rank other than rank 0: it runs the plans rank 0 broadcasts and,
    in a disaggregated engine, moves its own shards of each transfer (shard links)."""

    def __init__(self) -> None:
        self.shards: RankShards | None = None

    def run(self, init: bytes, device_index: int | None) -> None:
        logging.basicConfig(level=logging.WARNING)
        run_rank(init, device_index=device_index, share_cores=False, on_ready=self._attach)

    def _attach(self, runner: ModelRunner, config: EngineConfig) -> None:
        """Shard links over this rank's pools (before the rank reports ready)."""
        if config.role == "colocated":
            return
        backend = create_backend(
            config.transfer_backend, Pools.of(runner.caches), config.transfer_streams
        )
        layout = peer_layout(runner.model_config, config, runner.parallel.tp_rank)
        host = ray.util.get_node_ip_address()
        secret = config.transfer_secret
        if secret is None:
            raise ValueError("a disaggregated engine's ranks need its transfer_secret")
        self.shards = RankShards(
            receiver=ShardReceiver(layout, backend, secret=secret, host=host)
            if config.role == "decode"
            else None,
            sender=ShardSender(layout, backend, secret=secret)
            if config.role == "prefill"
            else None,
        )

    def _rank_shards(self) -> RankShards:
        if self.shards is None:
            raise TransferFailed("this rank has no shard links (not a disaggregated engine)")
        return self.shards

    def shard_address(self) -> list[Any]:
        return list(self._rank_shards().address())

    def shard_expect(self, request_id: str, plan: dict, sender: dict) -> None:
        self._rank_shards().expect(request_id, _plan(plan), PeerLayout.from_dict(sender))

    def shard_wait(self, request_id: str, timeout: float) -> None:
        self._rank_shards().wait(request_id, timeout)

    def shard_cancel(self, request_id: str) -> None:
        self._rank_shards().cancel(request_id)

    def shard_send(
        self,
        request_id: str,
        src_blocks: list[int],
        src_slot: int,
        plan: dict,
        receiver: dict,
        addresses: list[list[Any]],
    ) -> int:
        return self._rank_shards().send(
            request_id,
            src_blocks,
            src_slot,
            _plan(plan),
            PeerLayout.from_dict(receiver),
            [(str(a[0]), int(a[1])) for a in addresses],
        )


def _plan(data: dict) -> ReceivePlan:
    plan = from_dict(data)
    assert isinstance(plan, ReceivePlan)
    return plan


class RayRankShards:
    """A rank actor's shard links, for its engine's rank 0 (`RankShardsPort`). A rank that
    fails or dies fails the transfer, never the caller."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except (RayActorError, RayTaskError) as exc:
            lines = str(exc).strip().splitlines()
            raise TransferFailed(f"rank actor: {lines[-1] if lines else exc}") from exc

    def address(self) -> tuple[str, int]:
        host, port = self._call("shard_address")
        return str(host), int(port)

    def expect(self, request_id: str, plan: ReceivePlan, sender: PeerLayout) -> None:
        self._call("shard_expect", request_id, to_dict(plan), sender.to_dict())

    def wait(self, request_id: str, timeout: float) -> None:
        self._call("shard_wait", request_id, timeout)

    def cancel(self, request_id: str) -> None:
        with contextlib.suppress(TransferFailed):
            self._call("shard_cancel", request_id)

    def send(
        self,
        request_id: str,
        src_blocks: list[int],
        src_slot: int,
        plan: ReceivePlan,
        receiver: PeerLayout,
        addresses: list[tuple[str, int]],
    ) -> int:
        return self._call(
            "shard_send",
            request_id,
            src_blocks,
            src_slot,
            to_dict(plan),
            receiver.to_dict(),
            [list(a) for a in addresses],
        )


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
