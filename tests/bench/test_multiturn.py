"""`hybridserve bench multiturn`'s pure parts: workload, oracle, summary, table (no Ray)."""

from __future__ import annotations

import argparse
import random

import pytest

from hybridserve.bench.multiturn import add_arguments, run
from hybridserve.bench.multiturn_stats import (
    RequestRecord,
    format_table,
    make_workload,
    oracle_tokens,
    summarize,
)


def record(user, turn, start, end, prompt, output, *, ttft=None, cached=0, error=None, itls=()):
    return RequestRecord(
        user=user,
        turn=turn,
        start_s=start,
        end_s=end,
        ttft_s=ttft,
        itls_s=list(itls),
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        prompt_tokens=len(prompt),
        output_tokens=len(output),
        cached_tokens=cached,
        error=error,
    )


# Users 0 and 1 share the system prompt [1, 2, 3]; user 2 arrives while user 0's turn 2 runs;
# user 3's only request fails. Oracle per request in the comments.
HISTORY = [
    record(0, 1, 0.0, 1.0, [1, 2, 3, 4, 5], [6, 7], ttft=0.2, itls=[0.8]),  # 0: nothing done
    record(1, 1, 0.0, 1.5, [1, 2, 3, 9, 9, 9], [8], ttft=0.4),  # 0: user 0 not done yet
    record(3, 1, 0.5, None, [], [], error="APIError: boom"),  # 0, and never reusable
    # 7: user 0's turn 1 completed at the very instant this was sent (counts as before).
    record(0, 2, 1.0, 2.0, [1, 2, 3, 4, 5, 6, 7, 10, 11], [12], ttft=0.1, cached=6),
    # 4: user 0's turn 2 is still running, but its prompt was sent earlier: [1, 2, 3, 4].
    record(2, 1, 1.2, 2.2, [1, 2, 3, 4, 99], [5], ttft=0.3, cached=3),
    # 6: the whole prompt equals user 1's turn 1 prompt + output: capped at len(prompt) - 1.
    record(1, 2, 1.5, 2.5, [1, 2, 3, 9, 9, 9, 8], [4], ttft=0.1, cached=6),
]


def test_oracle_of_a_crafted_history():
    assert oracle_tokens(HISTORY) == [0, 0, 0, 7, 4, 6]


def brute_force_oracle(records):
    out = []
    for r in records:
        best = 0
        for other in records:
            sources = []
            if other.ok and other.end_s <= r.start_s:
                sources.append(other.prompt_token_ids + other.output_token_ids)
            if other.ok and other.start_s < r.start_s:
                sources.append(other.prompt_token_ids)
            for sequence in sources:
                n = 0
                while (
                    n < min(len(sequence), len(r.prompt_token_ids))
                    and sequence[n] == r.prompt_token_ids[n]
                ):
                    n += 1
                best = max(best, n)
        out.append(max(0, min(best, len(r.prompt_token_ids) - 1)))
    return out


def test_oracle_equals_brute_force_on_random_histories():
    rng = random.Random(7)
    for _ in range(50):
        records = []
        for i in range(rng.randint(1, 12)):
            start = rng.choice([0.0, 0.5, 1.0, 1.5, 2.0])
            end = None if rng.random() < 0.15 else start + rng.choice([0.5, 1.0])
            prompt = [rng.randint(0, 2) for _ in range(rng.randint(1, 8))]
            output = [rng.randint(0, 2) for _ in range(rng.randint(0, 3))]
            records.append(
                record(i, 1, start, end, prompt, output, error=None if end else "failed")
            )
        assert oracle_tokens(records) == brute_force_oracle(records)


def test_summary_has_vllm_keys_and_exact_reuse_figures():
    s = summarize(HISTORY, oracle_tokens(HISTORY), duration_s=2.5, percentiles=[50, 99])
    assert (s["completed"], s["failed"]) == (5, 1)
    assert (s["total_input"], s["total_output"]) == (32, 6)
    assert (s["cached_tokens"], s["oracle_tokens"]) == (15, 17)
    assert s["reused_fraction"] == pytest.approx(15 / 32)
    assert s["oracle_fraction"] == pytest.approx(17 / 32)
    assert s["reuse_vs_oracle"] == pytest.approx(15 / 17)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(2.4)
    assert s["total_token_throughput"] == pytest.approx(38 / 2.5)
    assert s["mean_ttft_ms"] == pytest.approx(220)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["p50_ttft_ms"] == pytest.approx(200)
    assert s["p99_ttft_ms"] == pytest.approx(300 + 0.96 * 100)  # linear, as numpy
    assert s["mean_e2el_ms"] == pytest.approx(1100)
    assert s["mean_tpot_ms"] == pytest.approx(800)  # only the request with 2 output tokens
    assert s["mean_itl_ms"] == pytest.approx(800)
    assert s["median_ttft_ms_per_turn"] == {1: pytest.approx(300), 2: pytest.approx(100)}
    assert s["input_lens"] == [5, 6, 0, 9, 5, 7]
    assert s["cached"] == [0, 0, 0, 6, 3, 6]
    assert s["oracle"] == [0, 0, 0, 7, 4, 6]
    assert s["turns"] == [1, 1, 1, 2, 1, 2]
    assert s["errors"] == ["", "", "APIError: boom", "", "", ""]
    for key in ("std_ttft_ms", "median_e2el_ms", "p99_itl_ms", "median_tpot_ms"):
        assert key in s


def test_summary_without_any_reuse_has_no_ratio():
    records = [record(0, 1, 0.0, 1.0, [1, 2], [3], ttft=0.5)]
    s = summarize(records, oracle_tokens(records), duration_s=1.0)
    assert (s["oracle_tokens"], s["reuse_vs_oracle"], s["reused_fraction"]) == (0, None, 0.0)


def test_table_rows_and_ratio_to_round_robin():
    base = summarize(HISTORY, oracle_tokens(HISTORY), duration_s=2.5)
    rr = dict(base, reused_fraction=base["reused_fraction"] / 2)
    table = format_table({"snapshot-aware": base, "round-robin": rr}).splitlines()
    assert table[0].split()[:3] == ["policy", "requests", "failed"]
    aware = table[2].split()
    assert aware[:6] == ["snapshot-aware", "6", "1", "46.9", "53.1", "0.88"]
    assert aware[6] == "2.00"
    assert table[3].split()[6] == "1.00"


def test_workload_is_seeded_and_shaped_as_asked():
    kwargs = dict(
        num_users=5,
        num_turns=3,
        num_system_prompts=2,
        system_prompt_len=200,
        user_context_len=50,
        user_len=30,
        seed=3,
    )
    workload = make_workload(**kwargs)
    assert workload == make_workload(**kwargs)
    assert workload != make_workload(**(kwargs | {"seed": 4}))
    assert [c.user for c in workload] == [0, 1, 2, 3, 4]
    systems = [c.system for c in workload]
    assert systems[0] == systems[2] == systems[4] != systems[1] == systems[3]
    assert all(len(s) == 200 and s.isascii() for s in systems)
    for c in workload:
        first, *rest = c.user_messages
        assert len(first) == 50 + 2 + 30 and first[50:52] == "\n\n"
        assert [len(m) for m in rest] == [30, 30]
    contexts = {c.user_messages[0][:50] for c in workload}
    assert len(contexts) == 5  # user-unique
    no_system = make_workload(**(kwargs | {"num_system_prompts": 0, "user_context_len": 0}))
    assert all(c.system is None and len(c.user_messages[0]) == 30 for c in no_system)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "exactly one of --base-url"),
        (["--launch", "--base-url", "http://x"], "exactly one of --base-url"),
        (["--launch", "--policies", "snapshot-aware,fastest"], "fastest"),
        (["--launch", "--num-turns", "0"], "--num-turns"),
        (["--base-url", "http://x", "--policies", "round-robin"], "--policies needs --launch"),
    ],
)
def test_bad_options_raise_before_anything_starts(argv, needle):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match=needle):
        run(parser.parse_args(argv))
