"""From a verify chunk's sampled rows to the tokens that stand.

A chunk that verifies k drafts samples k + 1 rows: row j at the position before draft j + 1
(row 0 at the last known token), row k after the last draft. The sampler draws row j as
usual, except that a row with a draft decides about that draft (sampler.py): greedy, its
token is its argmax; sampled, the draft is accepted with the probability the row gives it and
otherwise the token comes from the rest of the row's distribution (rejection sampling, so the
tokens that stand are distributed exactly as without speculation). Either way the row's token
equals its draft exactly when the draft is accepted, so settling is a walk:

    drafts:     d1   d2   d3   d4
    row tokens: d1   d2   x    .    .      -> accepted (d1, d2), then x; rows 3, 4 unused
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridserve.workers.core.outputs import Sample


def settle(row_samples: Sequence[Sample], draft_token_ids: Sequence[int]) -> Sample:
    """The chunk's sample from its rows' samples (one more than drafts): the drafts up to the
    first whose row drew another token, then the token of that row (of the last row when
    every draft stood)."""
    if not draft_token_ids:
        return row_samples[0]
    accepted = 0
    for draft, sample in zip(draft_token_ids, row_samples, strict=False):
        if sample.token_ids[0] != draft:
            break
        accepted += 1
    final = row_samples[accepted]
    logprobs = None
    if final.logprobs is not None:
        logprobs = tuple(sample.logprobs[0] for sample in row_samples[:accepted])  # type: ignore[index]
    return Sample(
        final.token_ids,
        final.logprobs,
        accepted=tuple(draft_token_ids[:accepted]),
        accepted_logprobs=logprobs,
        num_draft_tokens=len(draft_token_ids),
    )
