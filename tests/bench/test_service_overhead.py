"""The service overhead benchmark still runs end to end (quick mode): offline and served
figures side by side, through the ingress's own address on a cluster it starts."""

from __future__ import annotations

import pytest

from hybridserve.cluster.cpu_binding import free_cores, shares_a_pool

pytestmark = pytest.mark.slow


def test_quick_run_measures_each_shape_beside_the_offline_engine(run_bench):
    result = run_bench(
        "service_overhead.py",
        *("--quick", "--rounds", "2", "--torch-threads", "1", "--stream-interval", "3"),
        *("--sustained-requests", "1"),
    )
    systems = result["systems"]
    assert list(systems) == ["colocated t=1", "1P1D t=1", "colocated t=1 si=3", "1P1D t=1 si=3"]
    assert [row["stream_interval"] for row in systems.values()] == [1, 1, 3, 3]
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
    # cpu_binding "auto": one engine, or two of a thread each, each on a core of its own where
    # the node has them free.
    free = 0 if shares_a_pool() else len(free_cores())
    for label, row in systems.items():
        names = ["colocated-0"] if label.startswith("colocated") else ["prefill-0", "decode-0"]
        binding = row["cpu_binding"]
        assert list(binding) == names
        if free >= len(names):
            cores = [core for bound in binding.values() for core in bound]
            assert len(cores) == len(names) == len(set(cores))  # one each, none twice
        else:
            assert set(binding.values()) == {None}
