"""The host-side benchmarks of the GPU issue run end to end on the CPU (quick mode): step
overhead with no model work, async against synchronous scheduling, and the realistic-model
benchmark on its scaled-down shapes. Their figures are the benchmarks' findings; the tests
check that each is measured and consistent with its parts."""

from __future__ import annotations

import pytest


def test_step_overhead_with_no_model_work_reports_the_host_per_request(run_bench):
    result = run_bench(
        "step_overhead.py", "--quick", "--runner", "none", "--running", "1", "8",
        "--output-len", "24",
    )  # fmt: skip
    assert result["runner"] == "none"
    for r in result["results"]:
        per_request = (r["schedule_ms"] + r["update_ms"]) * 1e3 / r["running"]
        assert r["schedule_update_us_per_request"] == pytest.approx(per_request)
        assert 0 < r["execute_ms"] < r["step_ms"]


def test_async_scheduling_bench_compares_both_modes(run_bench):
    result = run_bench("async_scheduling.py", "--quick", "--running", "1", "4", "--repeats", "1")
    assert [r["running"] for r in result["results"]] == [1, 4]
    for r in result["results"]:
        assert r["speedup"] == pytest.approx(r["sync_step_ms"] / r["async_step_ms"])
        assert 0 <= r["async_host_visible"] < 1 and 0 <= r["sync_host_visible"] < 1


def test_realistic_model_bench_measures_every_figure_against_its_limit(run_bench):
    result = run_bench(
        "realistic_model.py", "--quick", "--device", "cpu", "--dtype", "float32",
        "--running", "1", "2", "--prefill-len", "256",
    )  # fmt: skip
    assert [r["model"] for r in result["results"]] == ["nemotron_h_8b", "qwen3_5_4b"]
    for r in result["results"]:
        assert [d["running"] for d in r["decode"]] == [1, 2]
        assert all(d["tokens_per_s"] > 0 and d["share_of_bandwidth_limit"] > 0 for d in r["decode"])
        assert r["prefill_tokens_per_s"] > 0 and r["prefill_share_of_compute_limit"] > 0
        ttft = r["multiturn_ttft_s"]
        assert len(ttft["with_reuse"]) == len(ttft["without_reuse"]) == 4
        # The later turns resume from a snapshot: less to compute than from scratch.
        assert sum(ttft["with_reuse"][1:]) < sum(ttft["without_reuse"][1:])
