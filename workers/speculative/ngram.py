"""Prompt lookup: the n-gram proposer.

The last n tokens of a request (prompt and output so far) are looked up earlier in the same
sequence, for n from `prompt_lookup_max` down to `prompt_lookup_min`; the tokens that followed
the most recent earlier occurrence of the longest suffix that occurs are the drafts. Code
edits, quotes and retrieval answers repeat their context, and there most drafts stand.

The lookup is incremental: each request keeps, per n, the end of the latest occurrence of
every n-gram seen so far (`NgramIndex`), and each step indexes only the tokens appended since
the last, so a proposal costs O(new tokens x n range), not O(sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class NgramIndex:
    """Per n-gram length: n-gram -> the index just past its latest occurrence that ends
    before the sequence's last token (the suffix itself is not an earlier occurrence)."""

    min_n: int
    max_n: int
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed_upto: int = 0  # occurrences ending at or before this index are indexed

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the longest repeated suffix."""
        length = len(token_ids)
        # Index the n-grams that end before the last token: an occurrence ending at `end`
        # (exclusive) can propose token_ids[end:], at least one token.
        for end in range(max(self.indexed_upto + 1, self.min_n), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends.setdefault(n, {})[tuple(token_ids[end - n : end])] = end
        self.indexed_upto = max(self.indexed_upto, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.ends.get(n, {}).get(tuple(token_ids[length - n :]))
            if end is not None:
                return token_ids[end : end + num_tokens]
        return []
