"""What a rank other than rank 0 does: execute what rank 0 broadcasts, until told to stop.

Rank 0 is the engine's own process: it schedules, then broadcasts each step plan to the other
ranks over the control channel and executes it itself; the forward pass's collectives keep the
ranks in step. A `RankLoop` is the loop on every other rank, wherever that rank runs (a
process of the `mp` executor here; a Ray actor in the service).

Messages are versioned msgpack values:

    plan    seq n, a StepPlan      execute it (n counts plans: a gap means one was lost)
    check   seq n, pool sizes      report problems: plans executed != n, pools not as agreed
    stop                           leave the loop
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Literal

import msgpack

from hybridserve.workers.core.step_plan import StepPlan
from hybridserve.workers.executors.distributed import ControlChannel
from hybridserve.workers.runner.model_runner import ModelRunner, PoolSizes

logger = logging.getLogger(__name__)

RANK_PROTOCOL_VERSION = 1
MessageKind = Literal["plan", "check", "stop"]


@dataclass(frozen=True)
class RankMessage:
    kind: MessageKind
    seq: int = 0
    plan: StepPlan | None = None
    sizes: PoolSizes | None = None

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {"v": RANK_PROTOCOL_VERSION, "kind": self.kind, "seq": self.seq}
        if self.plan is not None:
            body["plan"] = self.plan.to_dict()
        if self.sizes is not None:
            body["sizes"] = asdict(self.sizes)
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def from_bytes(cls, payload: bytes) -> RankMessage:
        data = msgpack.unpackb(payload, raw=False)
        if not isinstance(data, dict) or data.get("v") != RANK_PROTOCOL_VERSION:
            raise ValueError(f"rank message version is not {RANK_PROTOCOL_VERSION}: {data!r:.80}")
        kind = data.get("kind")
        if kind not in ("plan", "check", "stop"):
            raise ValueError(f"unknown rank message kind {kind!r}")
        try:
            plan = StepPlan.from_dict(data["plan"]) if "plan" in data else None
            sizes = PoolSizes(**data["sizes"]) if "sizes" in data else None
        except TypeError as exc:
            raise ValueError(f"malformed rank message: {exc}") from exc
        return cls(kind, int(data["seq"]), plan, sizes)


class RankLoop:
    def __init__(self, runner: ModelRunner, channel: ControlChannel, sizes: PoolSizes) -> None:
        self.runner = runner
        self.channel = channel
        self.sizes = sizes
        self.num_plans = 0

    @property
    def rank(self) -> int:
        return self.runner.parallel.tp_rank

    def serve(self) -> None:
        """Execute rank 0's messages until `stop` (or until the group fails, which raises)."""
        while True:
            message = RankMessage.from_bytes(self.channel.broadcast())
            if message.kind == "stop":
                logger.info("rank %d: stopped after %d plans", self.rank, self.num_plans)
                return
            if message.kind == "check":
                self.channel.gather(msgpack.packb(self.problems(message)))
                continue
            assert message.plan is not None
            self.num_plans += 1
            if message.seq != self.num_plans:
                raise RuntimeError(
                    f"rank {self.rank}: plan {message.seq} arrived after plan "
                    f"{self.num_plans - 1}: the ranks are out of step"
                )
            self.runner.execute(message.plan)

    def problems(self, check: RankMessage) -> list[str]:
        """What disagrees with rank 0: plans executed, or the pools' sizes."""
        problems = []
        if check.seq != self.num_plans:
            problems.append(
                f"rank {self.rank} executed {self.num_plans} plans, rank 0 sent {check.seq}"
            )
        if check.sizes is not None:
            problems += pool_problems(self.runner, check.sizes)
        return problems


def pool_problems(runner: ModelRunner, sizes: PoolSizes) -> list[str]:
    """Whether this rank's pools hold the blocks and slots every rank agreed on."""
    rank, caches, problems = runner.parallel.tp_rank, runner.caches, []
    if caches.kv is not None and caches.kv.shape[0] != sizes.num_kv_blocks:
        problems.append(
            f"rank {rank} has {caches.kv.shape[0]} KV blocks, the engine {sizes.num_kv_blocks}"
        )
    for name, pool in caches.state.items():
        if pool.shape[0] != sizes.num_state_slots:
            problems.append(
                f"rank {rank} has {pool.shape[0]} {name} slots, the engine {sizes.num_state_slots}"
            )
    return problems
