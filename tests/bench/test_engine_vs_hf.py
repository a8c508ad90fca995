"""The engine benchmark script still runs end to end (quick mode) and writes its JSON."""

from __future__ import annotations


def test_quick_run_writes_results(run_bench):
    result = run_bench("engine_vs_hf.py", "--quick")
    assert [row["concurrency"] for row in result["throughput"]] == [1, 8, 32]
    for row in result["throughput"]:
        assert row["ours_output_tokens_per_s"] > 0 and row["hf_output_tokens_per_s"] > 0
    assert result["prefill"]["ours_tokens_per_s"] > 0
