"""Cores of their own for the CPU engines of a node (`ServiceConfig.cpu_binding`).

Left to the OS, two engines on a node move between its cores: the prefill engine's step and
the decode engine's threads (or a Ray or Serve process) meet on one core now and then, and
every OpenMP barrier of a step then waits for the thread that lost its core. On the 2-core
benchmark VM, 1P1D with one thread per engine, binding each engine to a core of its own took
the time the service adds to the first token from +8.7 and +11.6 ms to +5.4 and +5.9 ms
(bench/service_overhead.py, two runs each).

The Coordinator asks each engine where it runs (`EnginePlacement`: its node, its threads and
the cores it may use that no other live process there has claimed), assigns cores with
`assign_cores`, and each engine claims its cores (`claim`) and binds its compute to them: the
thread that steps it and that thread's OpenMP team (`EngineHost.bind_cores`). The engine's
other threads (its event loop, transfer links, Ray's own) stay free to run on any core, as do
the router, the ingress and Ray's processes. Only where they fit: on a node whose CPU engines
need more threads than it has cores they share the cores unbound (and `cpu_wait_policy`
decides how their threads wait), and an engine that cannot be bound (a tensor-parallel one:
its ranks are other processes) leaves its node unbound. Binding is an optimisation: where
anything about it fails, the engines run unbound.

Two services on one node must not bind to the same cores: engines claim theirs in a file in the
node's temporary folder, one per user (a claim lasts as long as its process), and report only
the cores no other live process has claimed (`free_cores`); services of different users do not
see each other's claims. In a container whose CPU quota is smaller than the cores it may run
on, its cores are a pool it shares with other containers that cannot see its claims: nothing is
bound there (`shares_a_pool`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Node-local: which process holds which cores ({pid: {"start": its start time, "cores": [...]}}),
# shared by this user's services there (one file per user: a file another user created in a
# shared temporary folder may not be opened for writing). The start time tells a live holder
# from a later process that was given the same pid.
CLAIMS_FILE = Path(tempfile.gettempdir()) / f"hybridserve-cpu-claims-{os.getuid()}.json"
CGROUP = Path("/sys/fs/cgroup")


def node_cores(cgroup: Path = CGROUP) -> int:
    """The cores this process may run on: its CPU affinity, capped by its container's CPU
    quota (cgroup v2 `cpu.max`, or v1 `cpu/cpu.cfs_quota_us`), which affinity does not
    show."""
    cores = len(os.sched_getaffinity(0))
    for quota_file, period_file in (
        (cgroup / "cpu.max", None),
        (cgroup / "cpu" / "cpu.cfs_quota_us", cgroup / "cpu" / "cpu.cfs_period_us"),
    ):
        try:
            fields = quota_file.read_text().split()
            if period_file is not None:
                fields.append(period_file.read_text().strip())
            quota, period = int(fields[0]), int(fields[1])
        except (OSError, ValueError, IndexError):  # no such cgroup, or "max": no quota
            continue
        if quota > 0 and period > 0:
            return max(1, min(cores, math.ceil(quota / period)))
    return cores


def shares_a_pool(cgroup: Path = CGROUP) -> bool:
    """Whether this process's container may use fewer cores (its CPU quota) than it may run
    on: its cores are then a pool shared with other containers."""
    return node_cores(cgroup) < len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class EnginePlacement:
    """Where an engine's process runs, as the engine reports it."""

    name: str
    node_id: str
    num_threads: int  # its OpenMP team (torch's threads)
    cores: tuple[int, ...]  # the cores it may run on that no other live process has claimed
    bindable: bool = True  # False: its model runs in other processes too (an executor's)


def assign_cores(
    engines: Iterable[EnginePlacement],
    others: Iterable[EnginePlacement] = (),
    bound: Mapping[str, tuple[int, ...] | None] | None = None,
) -> dict[str, tuple[int, ...] | None]:
    """Engine name -> the cores to bind it to (None: unbound), for `engines`, in their order.

    `others`: engines already running (not reassigned), with `bound[name]` their cores (None
    or absent: unbound). On each node, `engines` take consecutive cores of their own from
    those every one of them may use and no bound engine holds, as many as their threads,
    where all of them fit, no other engine there floats unbound (it would still run on the
    bound cores) and every one of them can be bound; otherwise none of them is bound there.
    """
    bound = bound or {}
    by_node: dict[str, list[EnginePlacement]] = {}
    for engine in engines:
        by_node.setdefault(engine.node_id, []).append(engine)
    result: dict[str, tuple[int, ...] | None] = {}
    for node_id, placing in by_node.items():
        result.update(dict.fromkeys((e.name for e in placing), None))
        neighbours = [e for e in others if e.node_id == node_id]
        if any(bound.get(e.name) is None for e in neighbours):
            continue
        if not all(e.bindable for e in placing):
            continue
        held = {core for e in neighbours for core in bound[e.name] or ()}
        usable = set.intersection(*(set(e.cores) for e in placing)) - held
        free = sorted(usable)
        if sum(e.num_threads for e in placing) > len(free):
            continue
        for engine in placing:
            result[engine.name] = tuple(free[: engine.num_threads])
            free = free[engine.num_threads :]
    return result


@dataclass(frozen=True)
class Claim:
    """Cores held by the process that started at `start` (clock ticks after boot)."""

    start: int | None
    cores: list[int]


def free_cores(claims_file: Path = CLAIMS_FILE) -> tuple[int, ...] | None:
    """The cores this process may run on that no other live process on the node holds; None
    where the claims cannot be read (then nothing is bound)."""
    try:
        with _claims(claims_file) as claims:
            held = _held_by_others(claims)
    except OSError as exc:
        logger.warning("CPU claims in %s: %s; not binding", claims_file, exc)
        return None
    return tuple(sorted(os.sched_getaffinity(0) - held))


def claim(cores: list[int], claims_file: Path = CLAIMS_FILE) -> bool:
    """Claim `cores` for this process; False, with nothing claimed, where another live process
    holds one of them (another service placing its engines at the same moment) or the claims
    cannot be written."""
    try:
        with _claims(claims_file) as claims:
            if _held_by_others(claims) & set(cores):
                return False
            claims[os.getpid()] = Claim(process_start_time(os.getpid()), sorted(cores))
    except OSError as exc:
        logger.warning("CPU claims in %s: %s; not binding", claims_file, exc)
        return False
    return True


def _held_by_others(claims: Mapping[int, Claim]) -> set[int]:
    return {core for pid, held in claims.items() if pid != os.getpid() for core in held.cores}


@contextlib.contextmanager
def _claims(claims_file: Path) -> Iterator[dict[int, Claim]]:
    """The node's claims of live processes, under an exclusive lock; written back after."""
    fd = os.open(claims_file, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            text = file.read()
            try:
                stored = json.loads(text) if text.strip() else {}
                claims = {
                    int(pid): Claim(entry["start"], [int(core) for core in entry["cores"]])
                    for pid, entry in stored.items()
                }
            except (ValueError, TypeError, AttributeError, KeyError):
                logger.warning("%s: unreadable CPU claims, starting afresh", claims_file)
                claims = {}
            claims = {pid: held for pid, held in claims.items() if _alive(pid, held.start)}
            yield claims
            file.seek(0)
            file.truncate()
            json.dump(
                {
                    str(pid): {"start": held.start, "cores": held.cores}
                    for pid, held in claims.items()
                },
                file,
            )
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _alive(pid: int, start: int | None) -> bool:
    """Whether the process that made a claim still runs: its pid is taken, by a process that
    started when it did (where /proc tells)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    now = process_start_time(pid)
    return start is None or now is None or now == start


def process_start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks after boot (/proc/<pid>/stat); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces or parentheses: count after the last.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])  # the stat file's 22nd field
