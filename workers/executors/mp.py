"""The `mp` executor: one process per tensor-parallel rank, on this machine.

Rank 0 is the engine's process; ranks 1 .. tp-1 are started with `torch.multiprocessing`
spawn and run `run_rank` (workers/executors/rank_group.py has the start-up, the step and the failure
handling they share with the service's Ray ranks). The store and the groups are on loopback.
A rank process that loses its engine process leaves at once (a parent watcher), and an engine
dropped without `shutdown()` still takes its rank processes with it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import torch.multiprocessing as mp

from hybridserve.workers.executors.rank_group import RankGroupExecutor, run_rank


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
    try:
        run_rank(payload)
    except Exception:
        raise SystemExit(1) from None  # run_rank left the traceback in the store


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


class MultiprocExecutor(RankGroupExecutor):
    def _launch(self, inits: list[bytes]) -> None:
        context = mp.get_context("spawn")
        self._processes = [
            context.Process(
                target=_rank_process,
                args=(init,),
                name=f"hybridserve-rank{rank}",
                daemon=True,
            )
            for rank, init in enumerate(inits, start=1)
        ]
        with _main_module_hidden():
            for process in self._processes:
                process.start()
        # Collected without a shutdown: the ranks go with it (at exit, rank_group's hook
        # stops them cleanly first).
        weakref.finalize(self, _kill_all, self._processes).atexit = False

    def _exited(self, timeout: float) -> int | None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels), timeout=timeout)
        return sentinels[ready[0]] if ready else None  # type: ignore[index]

    def _exit_reason(self, rank: int) -> str | None:
        code = self._processes[rank - 1].exitcode
        return None if code is None else f"exit code {code}"

    def _stop_ranks(self) -> None:
        _kill_all(getattr(self, "_processes", []))
