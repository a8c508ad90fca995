"""The precision benchmarks still run end to end (quick mode) and measure what they claim:
FP8 weights take less memory than float ones, and an FP8 KV cache a quarter of float32's
bytes per token with a log-probability shift that is small but not zero."""

from __future__ import annotations


def test_fp8_weights_quick_run_reports_every_engine(run_bench):
    result = run_bench("fp8_weights.py", "--quick", "--repeats", "1")
    engines = result["engines"]
    assert set(engines) == {"float", "fp8 keep", "fp8 dequantize"}
    assert engines["fp8 keep"]["weight_bytes"] < 0.5 * engines["float"]["weight_bytes"]
    assert engines["fp8 dequantize"]["weight_bytes"] == engines["float"]["weight_bytes"]
    for row in engines.values():
        assert row["load_peak_bytes"] > 0
        assert all(row[f"{kind}_tok_s@{n}"] > 0 for kind in ("prefill", "decode") for n in (1, 8))


def test_kv_cache_dtype_quick_run_reports_divergence_and_cost(run_bench):
    result = run_bench("kv_cache_dtype.py", "--quick")
    assert len(result["first_divergence"]) == result["requests"]
    assert 0 < result["mean_abs_logprob_diff"] <= result["max_abs_logprob_diff"] < 1.0
    per_token = result["kv_bytes_per_token"]
    assert per_token["fp8"] * 4 == per_token["auto"]
