"""The transfer benchmark still runs end to end (one tiny size) and writes its JSON."""

from __future__ import annotations


def test_tiny_run_writes_results(run_bench):
    result = run_bench(
        "transfer.py", "--sizes-mib", "1", "--region-kib", "256", "--repeats", "1", timeout=300
    )
    assert result["benchmark"] == "transfer"
    assert result["config"]["region_bytes"] == 256 * 1024
    assert result["config"]["nixl_streams"] == 2  # the engine default
    [row] = result["rows"]
    assert (row["size_mib"], row["bytes"]) == (1, 1 << 20)
    assert row["memcpy"]["best_gb_per_s"] > 0 and row["memcpy_1thread"]["best_gb_per_s"] > 0
    # NIXL runs where it imports; otherwise the run says why and leaves its column empty.
    assert set(result["skipped"]) <= {"nixl"}
    for backend in ("nixl", "tcp"):
        stats = row[backend]
        if backend in result["skipped"]:
            assert stats is None
            continue
        assert stats["best_gb_per_s"] > 0 and stats["median_gb_per_s"] > 0
        assert stats["best_fraction_of_memcpy"] > 0


def test_tp2_to_tp1_run_moves_half_per_rank_pair_verified(run_bench):
    """Two sender ranks each hold one head of every region and send it at once; the run
    fails (instead of reporting) if any region arrives different from the unsharded one."""
    result = run_bench(
        "transfer.py",
        "--tp",
        "2",
        "--sizes-mib",
        "1",
        "--region-kib",
        "256",
        "--repeats",
        "1",
        "--backends",
        "tcp",
        timeout=300,
    )
    assert result["config"]["tp"] == "prefill TP 2 -> decode TP 1"
    [row] = result["rows"]
    assert row["bytes_per_rank_pair"] == (1 << 20) // 2 and row["verified"]
    assert row["tcp"]["best_gb_per_s"] > 0
