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
