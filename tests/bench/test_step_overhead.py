"""The step-overhead benchmark runs end to end (quick mode) and splits every step into parts
that nest inside it, and measures its GEMM floor; the native mode runs at one request only."""

from __future__ import annotations


def test_quick_run_splits_each_step_into_its_parts(run_bench):
    result = run_bench(
        "step_overhead.py", "--quick", "--running", "1", "4", "--modes", "eager", "native"
    )
    modes = [(r["mode"], r["running"]) for r in result["results"]]
    assert modes == [("eager", 1), ("eager", 4), ("native", 1)]
    for r in result["results"]:
        assert r["steps"] > 0
        assert r["step_ms"] > r["execute_ms"] > 0
        assert r["schedule_ms"] > 0 and r["update_ms"] > 0 and r["other_ms"] >= 0
        assert 0 < r["outside_share"] < 1
        # Every weight once, nothing else: below the runner's whole step.
        assert 0 < r["gemm_floor_ms"] < r["execute_ms"]
        assert r["step_over_floor"] > 1
