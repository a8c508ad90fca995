"""The step-overhead benchmark runs end to end (quick mode) and splits every step into parts
that nest inside it, and measures its GEMM floor; the native mode runs only where it applies
(up to MAX_ROWS decode rows). Which timing is larger than which is the benchmark's finding,
not the test's: two timings measured apart can flip on two loaded cores."""

from __future__ import annotations

import pytest

from hybridserve.workers.runner.paths.native import MAX_ROWS


def test_quick_run_splits_each_step_into_its_parts(run_bench):
    beyond = MAX_ROWS + 1
    result = run_bench(
        "step_overhead.py", "--quick", "--running", "1", str(beyond), "--modes", "eager", "native"
    )
    modes = [(r["mode"], r["running"]) for r in result["results"]]
    assert modes == [("eager", 1), ("eager", beyond), ("native", 1)]
    for r in result["results"]:
        assert r["steps"] > 0
        assert r["step_ms"] > r["execute_ms"] > 0
        assert r["schedule_ms"] > 0 and r["update_ms"] > 0 and r["other_ms"] >= 0
        assert 0 < r["outside_share"] < 1
        assert r["outside_share"] == pytest.approx((r["step_ms"] - r["execute_ms"]) / r["step_ms"])
        assert r["gemm_floor_ms"] > 0
        assert r["step_over_floor"] == pytest.approx(r["step_ms"] / r["gemm_floor_ms"])
