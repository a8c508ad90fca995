"""The Coordinator's view of its node: how many cores its engines share (affinity, capped by
a container's CPU quota). The Coordinator itself runs in the service tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybridserve.cluster.coordinator import node_cores

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
