"""Executors: where an engine's ranks run and how a step plan reaches them.

    uni   one rank, in the engine's process: `execute` is a call into the model runner
    mp    one process per rank (torch.multiprocessing spawn); rank 0 is the engine's process
          and broadcasts each plan over the process group (workers/executors/mp.py)
    ray   rank actors in a placement group; provided by the service (hybridserve.cluster)

Every executor loads one model shard per rank, agrees on the pools' sizes (block and slot ids
are the same on every rank: there is one scheduler), and returns rank 0's step result. A rank
that dies or stops answering makes `execute` raise `RankFailure`; the engine then ends every
request with that error and stops.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.core.step_plan import StepPlan
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.models.loader import Checkpoint
from hybridserve.workers.runner.model_runner import ModelRunner, PoolSizes, RunnerOutput


class RankFailure(RuntimeError):
    """A rank died, hung or failed a step: the engine cannot go on."""


class Executor(ABC):
    """Runs step plans on every rank of one engine."""

    #: Rank 0's runner, in the engine's process (its pools back the transceiver at TP 1).
    driver: ModelRunner
    #: The blocks and slots every rank holds (host tier: what every rank got).
    sizes: PoolSizes

    @abstractmethod
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run one plan on every rank; rank 0's result. Raises RankFailure."""

    def submit(self, plan: StepPlan) -> Future[RunnerOutput]:
        """Start one plan and return at once where the ranks run on their own (async
        scheduling); plans run in the order submitted, `execute` after them. Here: run it
        now."""
        future: Future[RunnerOutput] = Future()
        try:
            future.set_result(self.execute(plan))
        except RankFailure as exc:
            future.set_exception(exc)
        return future

    def check_ranks(self) -> None:  # noqa: B027 - one rank has nothing to compare
        """Raise if a rank disagrees with rank 0 (plans executed, pool sizes)."""

    def shutdown(self) -> None:  # noqa: B027 - nothing to stop in-process
        """Stop every rank other than rank 0; idempotent."""


class UniExecutor(Executor):
    """Tensor-parallel size 1: the runner is called directly, nothing is serialised. With
    async scheduling the runner works in a thread of its own, one plan after another, so the
    engine's thread schedules the next step while it runs (torch, the native step and CUDA
    leave the GIL while they work)."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        self.driver = ModelRunner(config, checkpoint, ParallelContext())
        sizes = self.driver.pool_sizes(max_model_len)
        self.driver.allocate_pools(sizes)
        memory = self.driver.memory
        assert memory is not None
        self.sizes = PoolSizes(
            sizes.num_kv_blocks,
            sizes.num_state_slots,
            memory.num_host_blocks,
            memory.num_host_slots,
        )
        self._worker = (
            ThreadPoolExecutor(1, "hybridserve-runner", initializer=self._enter_worker)
            if config.async_scheduling
            else None
        )

    def _enter_worker(self) -> None:
        # The current CUDA device is per thread.
        if self.driver.device.type == "cuda":
            torch.cuda.set_device(self.driver.device)

    def _run(self, plan: StepPlan) -> RunnerOutput:
        result = self.driver.execute(plan)
        assert result is not None
        return result

    def execute(self, plan: StepPlan) -> RunnerOutput:
        if self._worker is None:
            return self._run(plan)
        return self._worker.submit(self._run, plan).result()

    def submit(self, plan: StepPlan) -> Future[RunnerOutput]:
        if self._worker is None:
            return super().submit(plan)
        return self._worker.submit(self._run, plan)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


ExecutorFactory = Callable[[EngineConfig, Checkpoint, int], Executor]
_FACTORIES: dict[str, ExecutorFactory] = {"uni": UniExecutor}


def register_executor(name: str, factory: ExecutorFactory) -> None:
    """Make `distributed_executor_backend=name` start engines with `factory`."""
    _FACTORIES[name] = factory


def create_executor(config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> Executor:
    name = config.executor_backend
    if name == "mp" and "mp" not in _FACTORIES:
        from hybridserve.workers.executors.mp import MultiprocExecutor

        register_executor("mp", MultiprocExecutor)
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(
            f"distributed_executor_backend={name!r} is not available in this process "
            f"(available: {', '.join(sorted(_FACTORIES))}); 'ray' rank actors are started by "
            "the service (hybridserve.cluster)"
        )
    return factory(config, checkpoint, max_model_len)
