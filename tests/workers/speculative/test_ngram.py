"""Prompt lookup: the longest repeated suffix, its latest earlier occurrence, incrementally."""

from __future__ import annotations

import pytest

from hybridserve.workers.speculative.ngram import NgramIndex


@pytest.mark.parametrize(
    ("min_n", "tokens", "expected"),
    [
        (2, [1, 2, 3, 4, 9, 1, 2, 3], [4, 9, 1]),  # the 3-gram (1, 2, 3) occurred before
        (2, [5, 6, 7, 1, 6, 8, 7, 1, 6], [8, 7, 1]),  # (7, 1, 6) beats (1, 6)'s later match
        (2, [1, 2, 9, 1, 2, 7, 1, 2], [7, 1, 2]),  # the latest earlier occurrence wins
        (2, [1, 2, 3, 4], []),  # nothing repeats
        (2, [3, 3], []),  # (3,) repeats, but 1-grams are below prompt_lookup_min
        (1, [3, 3], [3]),
    ],
)
def test_the_longest_repeated_suffix_proposes_what_followed_it(min_n, tokens, expected):
    assert NgramIndex(min_n, 3).propose(tokens, 3) == expected


def test_lookup_is_incremental_and_equals_a_fresh_index():
    tokens = [4, 5, 6, 4, 5, 7, 4, 5, 6, 8, 4, 5]
    incremental = NgramIndex(2, 4)
    for length in range(1, len(tokens) + 1):
        fresh = NgramIndex(2, 4)
        assert incremental.propose(tokens[:length], 4) == fresh.propose(tokens[:length], 4)
