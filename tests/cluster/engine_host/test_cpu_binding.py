"""Cores for the CPU engines of a node: how many a node has (affinity, capped by a
container's CPU quota), which engine gets which (the spec's rules as worked examples), and
the node's claims, with processes of their own; and a thread's OpenMP team bound to a core
(kernels/threads.bind_team). The Coordinator binds real engines in the service tests
(tests/cluster/test_service.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridserve.cluster.engine_host.cpu_binding import (
    EnginePlacement,
    assign_cores,
    claim,
    free_cores,
    node_cores,
    process_start_time,
    shares_a_pool,
)

AFFINITY = len(os.sched_getaffinity(0))


def cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, AFFINITY),  # no cgroup files: the affinity
        ({"cpu.max": "max 100000\n"}, AFFINITY),  # v2, no quota
        ({"cpu.max": "50000 100000\n"}, 1),  # half a core: still one
        ({"cpu.max": "100000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, AFFINITY),
        ({"cpu.max": "garbage\n"}, AFFINITY),
    ],
)
def test_node_cores_is_the_affinity_capped_by_the_container_quota(tmp_path, files, expected):
    assert node_cores(cgroup(tmp_path, files)) == expected


def test_a_quota_above_the_affinity_does_not_raise_it(tmp_path):
    quota = f"{(AFFINITY + 3) * 100000} 100000\n"
    assert node_cores(cgroup(tmp_path, {"cpu.max": quota})) == AFFINITY


def test_a_container_with_less_quota_than_cores_shares_a_pool(tmp_path):
    assert not shares_a_pool(cgroup(tmp_path, {}))
    if AFFINITY > 1:
        assert shares_a_pool(cgroup(tmp_path, {"cpu.max": "100000 100000\n"}))


def engine(name: str, threads: int = 1, cores=(0, 1), node: str = "a", **more) -> EnginePlacement:
    return EnginePlacement(name, node, threads, tuple(cores), **more)


def test_engines_that_fit_take_consecutive_cores_of_their_own_in_order():
    placed = assign_cores([engine("prefill-0"), engine("decode-0")])
    assert placed == {"prefill-0": (0,), "decode-0": (1,)}
    wide = assign_cores(
        [engine("p", 2, range(8)), engine("d", 3, range(8)), engine("c", 1, range(8))]
    )
    assert wide == {"p": (0, 1), "d": (2, 3, 4), "c": (5,)}


def test_engines_that_do_not_fit_stay_unbound_all_of_them():
    assert assign_cores([engine("p", 2), engine("d", 1)]) == {"p": None, "d": None}
    # Three one-thread engines on two cores: none bound, not two of them.
    three = assign_cores([engine("p"), engine("d0"), engine("d1")])
    assert set(three.values()) == {None}


def test_only_cores_every_engine_may_use_and_no_one_holds_are_given():
    # The free cores each engine reported (another service holds core 0 and 3).
    placed = assign_cores([engine("p", cores=(1, 2, 4)), engine("d", cores=(2, 4, 5))])
    assert placed == {"p": (2,), "d": (4,)}


def test_each_node_is_assigned_on_its_own():
    placed = assign_cores(
        [engine("p", 2, node="a"), engine("d0", 2, node="b"), engine("d1", 1, node="b")]
    )
    assert placed == {"p": (0, 1), "d0": None, "d1": None}  # b: 3 threads on 2 cores


def test_a_tensor_parallel_engine_leaves_its_node_unbound():
    placed = assign_cores(
        [engine("p", node="a"), engine("d", node="a", bindable=False), engine("c", node="b")]
    )
    assert placed == {"p": None, "d": None, "c": (0,)}


def test_a_restarted_engine_takes_the_cores_its_node_has_free():
    running = [engine("p"), engine("d0", cores=(0, 1, 2))]
    bound = {"p": (0,), "d0": (1,)}
    restarted = engine("d1", cores=(0, 1, 2))
    assert assign_cores([restarted], running, bound) == {"d1": (2,)}
    # No core left for it: unbound.
    assert assign_cores([engine("d1")], running, bound) == {"d1": None}
    # An unbound engine on the node floats over every core: binding beside it gains nothing.
    assert assign_cores([restarted], running, {"p": (0,), "d0": None}) == {"d1": None}
    # Its old node's engines do not count on another node.
    assert assign_cores([engine("d1", node="b")], running, bound) == {"d1": (0,)}


BIND_TEAM = """
import json, os, sys, threading
import torch
from hybridserve.kernels.cpu import threads
torch.set_num_threads(2)
threads.follow_torch_threads()
bystander_ready, stop = threading.Event(), threading.Event()
bystander = threading.Thread(target=lambda: (bystander_ready.set(), stop.wait()))
bystander.start()
bystander_ready.wait()
torch.ones(1 << 20).sum()  # the OpenMP team exists
core = int(sys.argv[1])
ok = threads.bind_team([core])
torch.ones(1 << 20).sum()
masks = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
stop.set()
print(json.dumps({
    "ok": ok,
    "main": masks[threading.get_native_id()],
    "bystander": masks[bystander.native_id],
    "bound": sum(m == [core] for m in masks.values()),
}))
"""


def test_binding_a_team_confines_the_stepping_thread_and_its_openmp_threads_only():
    """The calling thread and its OpenMP team run on the given core; a thread of the same
    process outside the team (an event loop, Ray's) does not move."""
    cores = sorted(os.sched_getaffinity(0))
    run = subprocess.run(
        [sys.executable, "-c", BIND_TEAM, str(cores[-1])],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(run.stdout)
    assert result["ok"]
    assert result["main"] == [cores[-1]]
    assert result["bystander"] == cores
    assert result["bound"] >= 2  # the calling thread and at least one team member


def holding(pid: int, cores: list[int], start: int | None) -> str:
    return json.dumps({str(pid): {"start": start, "cores": cores}})


def test_a_live_process_s_claim_keeps_its_cores_and_a_dead_one_s_does_not(tmp_path):
    claims = tmp_path / "claims.json"
    core = min(os.sched_getaffinity(0))
    assert claim([core], claims)
    assert core in free_cores(claims)  # its own claim does not count against it
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start_time(holder.pid)
        assert start is not None
        claims.write_text(holding(holder.pid, [core], start))
        assert core not in free_cores(claims)
        assert not claim([core], claims)
        assert json.loads(claims.read_text()) == json.loads(holding(holder.pid, [core], start))
        # The same pid with another start time is a later process that was given the pid.
        claims.write_text(holding(holder.pid, [core], start - 1))
        assert core in free_cores(claims)
        assert json.loads(claims.read_text()) == {}
        claims.write_text(holding(holder.pid, [core], start))
    finally:
        holder.kill()
        holder.wait()
    assert core in free_cores(claims)  # its process is gone
    assert claim([core], claims)
    mine = json.loads(holding(os.getpid(), [core], process_start_time(os.getpid())))
    assert json.loads(claims.read_text()) == mine
    assert claim([], claims)  # given back
    assert json.loads(claims.read_text())[str(os.getpid())]["cores"] == []


@pytest.mark.parametrize(
    "text",
    # pid 1 always runs: a claim of it that were read would hold core 0
    ["{not json", '["a list"]', '{"1": "cores"}', '{"1": [0]}', '{"1": {"cores": [0]}}'],
)
def test_unreadable_claims_start_afresh(tmp_path, text):
    claims = tmp_path / "claims.json"
    claims.write_text(text)
    assert free_cores(claims) == tuple(sorted(os.sched_getaffinity(0)))


def test_claims_that_cannot_be_opened_mean_no_binding(tmp_path):
    missing = tmp_path / "no-such-folder" / "claims.json"
    assert free_cores(missing) is None
    assert not claim([0], missing)
