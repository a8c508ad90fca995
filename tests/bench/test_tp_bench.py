"""The tensor-parallel benchmark runs end to end (quick mode) and writes its JSON."""

from __future__ import annotations


def test_quick_run_splits_steps_into_compute_and_collectives(run_bench):
    result = run_bench("tp.py", "--quick", "--tp", "1", "2")
    assert [r["tp"] for r in result["results"]] == [1, 2]
    one, two = (r["decode"] for r in result["results"])
    assert one["collective_ms"] == 0 and one["all_reduce_bytes_per_token"] == 0
    # TP 2 decode: every sublayer and the embedding all-reduce `hidden` fp32 values per token.
    assert two["collective_calls_per_step"] > 0 and two["collective_ms"] > 0
    assert two["all_reduce_bytes_per_token"] == (12 + 1) * 128 * 4
    assert two["step_ms"] >= two["collective_ms"]
    for figures in (*[r["prefill"] for r in result["results"]], one, two):
        assert figures["steps"] > 0 and figures["step_ms"] > 0
