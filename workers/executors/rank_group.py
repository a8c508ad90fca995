"""An engine spread over ranks: rank 0 in the engine's process, ranks 1 .. tp-1 elsewhere.

What every multi-rank executor shares, whoever launches the other ranks (processes here, Ray
actors in the service):

    engine process (rank 0)                       every other rank
    TCPStore master on `store_host`                connect to the store
    load its shard, size the pools  -- "sizes" ->  load their shard, allocate the pools
    allocate its pools             <- "ready/r" -- (or "error/r" with the traceback)
    join the engine's groups        ============  join the engine's groups
    per step: broadcast the plan   ------------->  RankLoop: execute what rank 0 broadcasts
              execute it too       <== collectives in the forward pass ==>

Failure: a watchdog thread in the engine process watches the ranks and the step in flight. A
rank that exits, or a step that has not finished after `distributed_timeout_seconds`, stops
every rank, which makes rank 0's blocked collective fail at once; `execute` then raises
`RankFailure` naming the rank and its error. See docs/step-plan.md.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import threading
import time
import traceback
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.core.step_plan import StepPlan
from hybridserve.workers.executors.distributed import (
    ControlChannel,
    Group,
    TorchCollectives,
    init_groups,
)
from hybridserve.workers.executors.executor import Executor, RankFailure
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.executors.rank import RankLoop, RankMessage, pool_problems
from hybridserve.workers.models.loader import Checkpoint, open_checkpoint
from hybridserve.workers.runner.model_runner import ModelRunner, PoolSizes, RunnerOutput

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_SECONDS = 600.0
WATCH_INTERVAL_SECONDS = 0.2
DEATH_GRACE_SECONDS = 1.0  # how long a broken collective waits to see whether a rank died
INIT_VERSION = 1


@dataclass(frozen=True)
class RankInit:
    """What a rank is started with (msgpack: launchers carry only bytes)."""

    config: dict[str, Any]  # EngineConfig, as JSON values
    rank: int
    world_size: int
    store_port: int
    store_host: str = "127.0.0.1"

    def to_bytes(self) -> bytes:
        return msgpack.packb({"v": INIT_VERSION, **asdict(self)}, use_bin_type=True)

    @classmethod
    def from_bytes(cls, payload: bytes) -> RankInit:
        data = msgpack.unpackb(payload, raw=False)
        if data.pop("v", None) != INIT_VERSION:
            raise ValueError(f"rank init version is not {INIT_VERSION}")
        return cls(**data)


def threads_per_rank(world_size: int) -> int:
    """CPU ranks on one machine share its cores instead of each taking all of them."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _store(host: str, port: int, world_size: int, *, master: bool) -> dist.TCPStore:
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=master,
        timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_SECONDS),
        wait_for_workers=False,
    )


def _parallel(config: EngineConfig, rank: int, world_size: int) -> ParallelContext:
    return ParallelContext(world_size, rank, config.enable_expert_parallel, TorchCollectives())


def _join(
    store: dist.Store, parallel: ParallelContext, device: torch.device
) -> tuple[Group, ControlChannel]:
    """Join the engine's groups and bind the forward pass's collectives to the device group."""
    device_group, control_group = init_groups(store, parallel.tp_rank, parallel.tp_size, device)
    assert isinstance(parallel.collectives, TorchCollectives)
    parallel.collectives.group = device_group
    return device_group, ControlChannel(control_group)


def run_rank(
    payload: bytes,
    *,
    device_index: int | None = None,
    share_cores: bool = True,
    on_ready: Callable[[ModelRunner, EngineConfig], None] | None = None,
) -> None:
    """A rank other than rank 0, from start-up to `stop`: load, allocate, report, join, serve.
    `on_ready` sees the rank's runner once its pools exist (a Ray rank attaches its transfer
    links there). Any failure is written to the store (rank 0 reports it) before it is raised."""
    init = RankInit.from_bytes(payload)
    store = _store(init.store_host, init.store_port, init.world_size, master=False)
    try:
        config = EngineConfig(**init.config)
        parallel = _parallel(config, init.rank, init.world_size)
        checkpoint = open_checkpoint(config.model, config.load_format)
        runner = ModelRunner(config, checkpoint, parallel, device_index)
        if runner.device.type == "cpu" and share_cores:
            torch.set_num_threads(threads_per_rank(init.world_size))
        sizes = PoolSizes(**msgpack.unpackb(store.get("sizes"), raw=False))
        runner.allocate_pools(sizes, (sizes.num_host_blocks, sizes.num_host_slots))
        assert runner.memory is not None
        if on_ready is not None:
            on_ready(runner, config)
        got = [runner.memory.num_host_blocks, runner.memory.num_host_slots]
        store.set(f"ready/{init.rank}", msgpack.packb(got))
        _, channel = _join(store, parallel, runner.device)
        RankLoop(runner, channel, sizes).serve()
    except Exception:
        store.set(f"error/{init.rank}", traceback.format_exc())
        raise


# Executors whose ranks run: at interpreter exit each is shut down as `shutdown()` does (its
# ranks told to stop and awaited), before anything kills them: a script that made an LLM of
# several ranks and ends exits 0, quietly. Registered at import, so it runs after the exit
# hooks registered later (atexit runs last-in first-out), multiprocessing's among them.
_RUNNING: weakref.WeakSet[RankGroupExecutor] = weakref.WeakSet()


@atexit.register
def _shut_down_running() -> None:
    for executor in list(_RUNNING):
        executor.shutdown()


class RankGroupExecutor(Executor):
    """Rank 0's side of a multi-rank engine; subclasses launch and supervise the others."""

    #: Where the other ranks reach this process's store.
    store_host = "127.0.0.1"
    #: Whether the ranks share this machine's cores (one machine, no per-rank allotment).
    share_cores = True

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        self.world_size = config.tensor_parallel_size
        self.timeout = config.distributed_timeout_seconds
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._step_started: float | None = None
        self._num_plans = 0
        self._threads_before: int | None = None
        self._store = _store(self.store_host, 0, self.world_size, master=True)
        inits = [
            RankInit(
                config.model_dump(mode="json"),
                rank,
                self.world_size,
                self._store.port,
                self.store_host,
            ).to_bytes()
            for rank in range(1, self.world_size)
        ]
        try:
            self._launch(inits)
            self._start_driver(config, checkpoint, max_model_len)
        except BaseException:
            self._stopping = True
            self.shutdown()  # stops the ranks, gives this process its threads back
            raise
        self._watchdog = threading.Thread(
            target=self._watch, name="hybridserve-rank-watchdog", daemon=True
        )
        self._watchdog.start()
        _RUNNING.add(self)
        logger.info("%d ranks ready (%s)", self.world_size, type(self).__name__)

    # ---- what a launcher provides ---------------------------------------------------------

    @abstractmethod
    def _launch(self, inits: list[bytes]) -> None:
        """Start ranks 1 .. tp-1, each running `run_rank(inits[rank - 1])`."""

    @abstractmethod
    def _exited(self, timeout: float) -> int | None:
        """Wait up to `timeout` for a rank to exit; the rank, or None."""

    @abstractmethod
    def _exit_reason(self, rank: int) -> str | None:
        """Why `rank` ended (an exit code, an error), or None while it runs."""

    @abstractmethod
    def _stop_ranks(self) -> None:
        """Stop every other rank now, whatever it is doing; idempotent."""

    # ---- start-up -------------------------------------------------------------------------

    def _start_driver(self, config: EngineConfig, checkpoint: Checkpoint, max_len: int) -> None:
        parallel = _parallel(config, 0, self.world_size)
        self.driver = ModelRunner(config, checkpoint, parallel)
        if self.driver.device.type == "cpu" and self.share_cores:
            # This process is rank 0: it shares the cores too, until shutdown.
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads_per_rank(self.world_size))
        sizes = self.driver.pool_sizes(max_len)
        self.driver.allocate_pools(sizes)
        memory = self.driver.memory
        assert memory is not None
        host = [memory.num_host_blocks, memory.num_host_slots]
        offer = PoolSizes(sizes.num_kv_blocks, sizes.num_state_slots, *host)
        self._store.set("sizes", msgpack.packb(asdict(offer)))
        for rank in range(1, self.world_size):
            got = msgpack.unpackb(self._wait_for(f"ready/{rank}", rank), raw=False)
            host = [min(a, b) for a, b in zip(host, got, strict=True)]
        # Every rank holds the same ids: the host tier is what the smallest rank got.
        self.sizes = PoolSizes(sizes.num_kv_blocks, sizes.num_state_slots, *host)
        self._device_group, self.channel = _join(self._store, parallel, self.driver.device)

    def _wait_for(self, key: str, rank: int) -> bytes:
        """A rank's start-up key; raises with its error if it failed or exited first."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while not self._store.check([key]):
            if self._store.check([f"error/{rank}"]) or self._exit_reason(rank) is not None:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} failed to start: {self._why(rank)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} did not start within {STARTUP_TIMEOUT_SECONDS} s"
                )
            time.sleep(0.02)
        return self._store.get(key)

    # ---- steps ----------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> RunnerOutput:
        with self._on_every_rank("the step"):
            self._num_plans += 1
            self.channel.broadcast(RankMessage("plan", self._num_plans, plan).to_bytes())
            result = self.driver.execute(plan)
        assert result is not None
        return result

    def check_ranks(self) -> None:
        """Every rank executed every plan, and holds the pools every rank agreed on."""
        with self._on_every_rank("the rank check"):
            check = RankMessage("check", self._num_plans, sizes=self.sizes)
            self.channel.broadcast(check.to_bytes())
            reports = self.channel.gather(msgpack.packb(pool_problems(self.driver, self.sizes)))
        assert reports is not None
        problems = [p for report in reports for p in msgpack.unpackb(report, raw=False)]
        if problems:
            raise RuntimeError("tensor-parallel rank check failed: " + "; ".join(problems))

    @contextlib.contextmanager
    def _on_every_rank(self, what: str) -> Iterator[None]:
        """Something all ranks take part in: timed by the watchdog; any failure stops the
        ranks (they are out of step from then on) and raises RankFailure."""
        self._raise_if_failed()
        self._step_started = time.monotonic()
        try:
            yield
        except Exception as exc:
            self._fail(f"{what} failed on rank 0 or in a collective ({exc})")
            raise RankFailure(self.failure) from exc
        finally:
            self._step_started = None

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)
        if self._stopping:
            raise RankFailure("the engine's ranks were shut down")

    # ---- failure and shutdown -------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping and self.failure is None:
            rank = self._exited(WATCH_INTERVAL_SECONDS)
            if self._stopping:
                return
            if rank is not None:
                self._fail(f"tensor-parallel rank {rank} died: {self._why(rank)}")
                return
            started = self._step_started
            if started is not None and time.monotonic() - started > self.timeout:
                self._fail(
                    f"a step did not finish within distributed_timeout_seconds={self.timeout} s "
                    "(a rank is hung); the ranks were stopped"
                )
                return

    def _fail(self, reason: str) -> None:
        # A rank that died first explains more than the collective that noticed it; its exit
        # may be seen a moment after its peers' collective broke, so wait that moment.
        deadline = time.monotonic() + DEATH_GRACE_SECONDS
        while "died" not in reason and time.monotonic() < deadline and not self._dead_ranks():
            time.sleep(0.02)
        with self._lock:
            if self.failure is None:
                dead = self._dead_ranks()
                if dead and "died" not in reason:
                    reason = f"tensor-parallel rank {dead[0]} died: {self._why(dead[0])}"
                self.failure = reason
                logger.error("engine ranks failed: %s", reason)
        self._stop_ranks()
        if self.driver.device.type == "cuda":
            self._device_group.pg.abort()  # NCCL: a collective on a dead peer would block

    def _dead_ranks(self) -> list[int]:
        return [r for r in range(1, self.world_size) if self._exit_reason(r) is not None]

    def _why(self, rank: int) -> str:
        key = f"error/{rank}"
        if self._store.check([key]):
            error = self._store.get(key).decode(errors="replace").strip().splitlines()
            return error[-1] if error else "an error"
        deadline = time.monotonic() + DEATH_GRACE_SECONDS  # its exit status may lag its exit
        while self._exit_reason(rank) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self._exit_reason(rank) or "it stopped answering"

    def shutdown(self) -> None:
        _RUNNING.discard(self)
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if self._stopping:
            self._stop_ranks()
            return
        self._stopping = True
        if self.failure is None:
            try:
                self.channel.broadcast(RankMessage("stop").to_bytes())
                deadline = time.monotonic() + 10
                ranks = range(1, self.world_size)
                while time.monotonic() < deadline and not all(map(self._exit_reason, ranks)):
                    time.sleep(0.05)
            except Exception as exc:  # the ranks are going away regardless
                logger.warning("ranks did not stop cleanly: %s", exc)
        self._stop_ranks()
