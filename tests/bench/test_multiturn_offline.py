"""The offline multi-turn benchmark still runs end to end (quick mode) and reuses prefixes."""

from __future__ import annotations

import itertools

import pytest


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_quick_run_reuses_every_later_turn(run_bench, family):
    result = run_bench("multiturn_offline.py", "--quick", "--family", family)
    assert result["family"] == family
    turns = result["turns"]
    assert turns[-1]["prompt_tokens"] >= 400
    assert turns[0]["cached_tokens"] == 0
    # Every later turn resumes exactly where the previous turn's prompt ended.
    for previous, turn in itertools.pairwise(turns):
        assert turn["cached_tokens"] == previous["prompt_tokens"]
    assert result["cache_stats"]["hits"] >= len(turns) - 1
    assert result["snapshot_bytes_per_request"] > 0
