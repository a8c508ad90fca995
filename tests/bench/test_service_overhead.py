"""The service overhead benchmark still runs end to end (the tiny model): offline and served
figures side by side, through the ingress's own address on a cluster it starts."""

from __future__ import annotations

import pytest

from hybridserve.cluster.engine_host.cpu_binding import EnginePlacement, assign_cores

pytestmark = pytest.mark.slow


def test_quick_run_measures_each_shape_beside_the_offline_engine(run_bench):
    result = run_bench(
        "service_overhead.py",
        *("--model", "tiny", "--rounds", "2", "--torch-threads", "1", "--sustained-requests", "1"),
        *("--stream-interval", "1"),
    )
    systems = result["systems"]
    # (A --stream-interval over 1 adds each system again at that interval: a deployment
    # each, so left out here; the interval itself is tested in tests/cluster/test_service.py.)
    assert list(systems) == ["colocated t=1", "1P1D t=1"]
    assert [row["stream_interval"] for row in systems.values()] == [1, 1]
    for row in systems.values():
        assert row["entry"] == "direct ingress"
        offline, service = row["offline"], row["service"]
        for figures in (offline, service):
            assert figures["ttft_ms"] > 0 and figures["itl_ms"] > 0
            assert figures["output_tokens_per_s"] > 0
            assert figures["sustained_output_tokens_per_s"] > 0
        assert row["ttft_added_ms"] == pytest.approx(service["ttft_ms"] - offline["ttft_ms"])
        assert row["itl_ratio"] == pytest.approx(service["itl_ms"] / offline["itl_ms"])
        assert row["cpu_wait_policy"] == "active"  # 1 thread per engine: nothing spins
        assert row["offline_threads"] == 1  # as many as the run's largest engine
    # cpu_binding "auto": each run's engines got what assign_cores gives them from what they
    # reported when placed; one engine, or two of a thread each, on cores of their own.
    for label, row in systems.items():
        names = ["colocated-0"] if label.startswith("colocated") else ["prefill-0", "decode-0"]
        binding = row["cpu_binding"]
        assert list(binding) == names
        placed = [
            EnginePlacement(**{**p, "cores": tuple(p["cores"])}) for p in row["cpu_placements"]
        ]
        expected = assign_cores(placed)
        assert {n: None if c is None else list(c) for n, c in expected.items()} == binding
        if all(p.bindable and len(p.cores) >= len(names) for p in placed):
            cores = [core for bound in binding.values() for core in bound]
            assert len(cores) == len(names) == len(set(cores))  # one each, none twice
