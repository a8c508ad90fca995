"""The routing benchmark runs end to end (small sizes): both designs built from the same
events, the same route from each (the benchmark checks it), and every figure reported."""

from __future__ import annotations

import pytest


def test_routing_bench_reports_both_designs_per_size(run_bench):
    result = run_bench(
        "routing.py", "--engines", "4", "16", "--prompt-tokens", "256", "--rounds", "1"
    )
    rows = result["rows"]
    assert [(r["engines"], r["prompt_tokens"]) for r in rows] == [(4, 256), (16, 256)]
    for r in rows:
        # A system prompt of 8 blocks, and 4 conversations of 8 blocks, on every engine.
        assert r["blocks_held"] == r["engines"] * (8 + 4 * 8)
        assert r["distinct_blocks"] == 8 + r["engines"] * 4 * 8
        assert r["speedup"] == pytest.approx(r["before_ms"] / r["after_ms"], rel=0.06)
        assert r["after_bytes_per_held_block"] > 0 and r["before_bytes_per_held_block"] > 0


def test_routing_simulator_compares_the_policies_against_the_oracle(run_bench, tmp_path):
    result = run_bench(
        "routing_simulator.py", "--quick", "--engines", "8",
        "--policies", "snapshot-aware", "round-robin", "oracle",
    )  # fmt: skip
    rows = {r["policy"]: r for r in result["rows"]}
    assert list(rows) == ["snapshot-aware", "round-robin", "oracle"]
    assert rows["oracle"]["requests"] > 0
    assert {r["requests"] for r in rows.values()} == {rows["oracle"]["requests"]}
    assert rows["oracle"]["reuse_vs_oracle"] == 1.0
    # Same traffic, same seed: routing by what engines hold beats ignoring it.
    assert rows["snapshot-aware"]["reused_fraction"] > rows["round-robin"]["reused_fraction"]
    assert (tmp_path / "routing_simulator.png").exists()
