"""The `mp` executor: one process per tensor-parallel rank, on this machine.

    engine process (rank 0)                       rank processes 1 .. tp-1 (spawned)
    TCPStore master on 127.0.0.1                   connect to the store
    load its shard, size the pools  -- "sizes" ->  load their shard, allocate the pools
    allocate its pools             <- "ready/r" -- (or "error/r" with the traceback, exit 1)
    join the process group          ============  join the process group
    per step: broadcast the plan   ------------->  RankWorker: execute what rank 0 broadcasts
              execute it too       <== collectives in the forward pass ==>

Failure: a watchdog thread in the engine process watches the rank processes and the step in
flight. A rank that exits, or a step that has not finished after `distributed_timeout_seconds`,
stops every rank (SIGKILL), which makes rank 0's blocked collective fail at once; `execute`
then raises `RankFailure` naming the rank and its error. Rank processes also leave on their own
when the engine process goes away (a parent watcher and the closed group), so none outlives it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing.connection
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridserve.workers.config import EngineConfig
from hybridserve.workers.distributed import ControlChannel, Group, TorchCollectives, init_groups
from hybridserve.workers.executor import Executor, RankFailure
from hybridserve.workers.model_runner import ModelRunner, PoolSizes, RunnerOutput
from hybridserve.workers.models.loader import Checkpoint, open_checkpoint
from hybridserve.workers.parallel import ParallelContext
from hybridserve.workers.rank import RankMessage, RankWorker, pool_problems
from hybridserve.workers.step_plan import StepPlan

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_SECONDS = 600.0
INIT_VERSION = 1


@dataclass(frozen=True)
class RankInit:
    """What a rank process is started with (msgpack: the process launcher carries only bytes)."""

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
    """CPU ranks share the machine's cores instead of each taking all of them."""
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


def _watch_parent() -> None:
    """Leave as soon as the engine process is gone (re-parenting changes our parent id)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _rank_process(payload: bytes) -> None:
    """Entry point of rank processes 1 .. tp-1."""
    _watch_parent()
    logging.basicConfig(level=os.environ.get("HYBRIDSERVE_LOG_LEVEL", "WARNING"))
    init = RankInit.from_bytes(payload)
    store = _store(init.store_host, init.store_port, init.world_size, master=False)
    try:
        config = EngineConfig(**init.config)
        parallel = _parallel(config, init.rank, init.world_size)
        runner = ModelRunner(config, open_checkpoint(config.model), parallel)
        if runner.device.type == "cpu":
            torch.set_num_threads(threads_per_rank(init.world_size))
        sizes = PoolSizes(**msgpack.unpackb(store.get("sizes"), raw=False))
        runner.allocate_pools(sizes, (sizes.num_host_blocks, sizes.num_host_slots))
        assert runner.memory is not None
        got = [runner.memory.num_host_blocks, runner.memory.num_host_slots]
        store.set(f"ready/{init.rank}", msgpack.packb(got))
        _, channel = _join(store, parallel, runner.device)
        RankWorker(runner, channel, sizes).serve()
    except Exception:
        store.set(f"error/{init.rank}", traceback.format_exc())
        raise SystemExit(1) from None


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start rank processes without re-running the caller's script: spawn imports the main
    module into every child (so a script without an `if __name__ == "__main__"` guard would
    build its engine again, recursively). Rank processes need nothing from it."""
    main = sys.modules["__main__"]
    saved = {
        name: main.__dict__.pop(name) for name in ("__file__", "__spec__") if name in main.__dict__
    }
    main.__spec__ = None  # type: ignore[assignment]
    try:
        yield
    finally:
        del main.__spec__
        main.__dict__.update(saved)


def _kill_all(processes: list[mp.Process]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=10)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        self.world_size = config.tensor_parallel_size
        self.timeout = config.distributed_timeout_seconds
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._step_started: float | None = None
        self._num_plans = 0
        self._threads_before: int | None = None
        self._store = _store("127.0.0.1", 0, self.world_size, master=True)
        context = mp.get_context("spawn")
        self._processes = [
            context.Process(
                target=_rank_process,
                args=(
                    RankInit(
                        config.model_dump(mode="json"), rank, self.world_size, self._store.port
                    ).to_bytes(),
                ),
                name=f"hybridserve-rank{rank}",
                daemon=True,
            )
            for rank in range(1, self.world_size)
        ]
        with _main_module_hidden():
            for process in self._processes:
                process.start()
        # An engine dropped without shutdown() still takes its rank processes with it.
        weakref.finalize(self, _kill_all, self._processes)
        try:
            self._start_driver(config, checkpoint, max_model_len)
        except BaseException:
            self._stopping = True
            self.shutdown()  # kills the ranks, gives this process its threads back
            raise
        self._watchdog = threading.Thread(
            target=self._watch, name="hybridserve-rank-watchdog", daemon=True
        )
        self._watchdog.start()
        logger.info("%d ranks ready (mp executor)", self.world_size)

    def _start_driver(self, config: EngineConfig, checkpoint: Checkpoint, max_len: int) -> None:
        parallel = _parallel(config, 0, self.world_size)
        self.driver = ModelRunner(config, checkpoint, parallel)
        if self.driver.device.type == "cpu":
            # This process is rank 0: it shares the cores too, until shutdown.
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads_per_rank(self.world_size))
        sizes = self.driver.pool_sizes(max_len)
        self.driver.allocate_pools(sizes)
        memory = self.driver.memory
        assert memory is not None
        host = [memory.num_host_blocks, memory.num_host_slots]
        offer = PoolSizes(sizes.num_kv_blocks, sizes.num_mamba_slots, *host)
        self._store.set("sizes", msgpack.packb(asdict(offer)))
        for rank in range(1, self.world_size):
            got = msgpack.unpackb(self._wait_for(f"ready/{rank}", rank), raw=False)
            host = [min(a, b) for a, b in zip(host, got, strict=True)]
        # Every rank holds the same ids: the host tier is what the smallest rank got.
        self.sizes = PoolSizes(sizes.num_kv_blocks, sizes.num_mamba_slots, *host)
        self._device_group, self.channel = _join(self._store, parallel, self.driver.device)

    def _wait_for(self, key: str, rank: int) -> bytes:
        """A rank's start-up key; raises with its error if it failed or exited first."""
        process = self._processes[rank - 1]
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while not self._store.check([key]):
            if self._store.check([f"error/{rank}"]) or not process.is_alive():
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
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes, start=1)}
        while not self._stopping and self.failure is None:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.2)
            if self._stopping:
                return
            if ready:
                rank = sentinels[ready[0]]  # type: ignore[index]
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
        with self._lock:
            if self.failure is None:
                # A rank that died first explains more than the collective that noticed it.
                dead = [r for r, p in enumerate(self._processes, start=1) if not p.is_alive()]
                if dead and "died" not in reason:
                    reason = f"tensor-parallel rank {dead[0]} died: {self._why(dead[0])}"
                self.failure = reason
                logger.error("engine ranks failed: %s", reason)
        self._kill()
        if self.driver.device.type == "cuda":
            self._device_group.pg.abort()  # NCCL: a collective on a dead peer would block

    def _why(self, rank: int) -> str:
        process = self._processes[rank - 1]
        key = f"error/{rank}"
        if self._store.check([key]):
            error = self._store.get(key).decode(errors="replace").strip().splitlines()
            return error[-1] if error else "an error"
        if process.exitcode is None:
            return "it stopped answering"
        return f"exit code {process.exitcode}"

    def _kill(self) -> None:
        _kill_all(self._processes)

    def shutdown(self) -> None:
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if self._stopping:
            self._kill()
            return
        self._stopping = True
        if self.failure is None:
            try:
                self.channel.broadcast(RankMessage("stop").to_bytes())
                for process in self._processes:
                    process.join(timeout=10)
            except Exception as exc:  # the ranks are going away regardless
                logger.warning("ranks did not stop cleanly: %s", exc)
        self._kill()
