"""Verification: which drafts stand, and that sampled tokens keep the target's distribution.

The oracle for sampling is a Markov chain over a tiny vocabulary: each row's logits are the
chain's row for the token before it, so a sequence drawn through verify steps must be
distributed as the chain says, whatever the drafts. A chi-square test over the first three
tokens checks it at a fixed seed set, and the same test must reject a sampler whose uniform
numbers are skewed (its power)."""

from __future__ import annotations

import pytest
import torch

from hybridserve.workers.core.outputs import Sample
from hybridserve.workers.core.step_plan import SamplingRow
from hybridserve.workers.runner import sampler as sampler_module
from hybridserve.workers.runner.sampler import Sampler
from hybridserve.workers.speculative.verification import settle

VOCAB, LENGTH, SEQUENCES = 3, 3, 6000
CHAIN = torch.log(
    torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.45, 0.45, 0.1]], dtype=torch.float32)
)


@pytest.mark.parametrize(
    ("row_tokens", "accepted", "final"),
    [
        ([7, 8, 9, 5], (7, 8, 9), 5),  # every draft stood: the last row adds one
        ([7, 3, 9, 5], (7,), 3),  # the second was rejected: its row's token replaces it
        ([1, 8, 9, 5], (), 1),
    ],
)
def test_settle_accepts_up_to_the_first_draft_its_row_disagrees_with(row_tokens, accepted, final):
    samples = [Sample((token,)) for token in row_tokens]
    settled = settle(samples, [7, 8, 9])
    assert (settled.accepted, settled.token_ids, settled.num_draft_tokens) == (
        accepted,
        (final,),
        3,
    )


def test_greedy_rows_test_drafts_against_the_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    rows = [SamplingRow(0.0, 1.0, None, (i,), num_logprobs=1) for i in range(3)]
    settled = settle(Sampler().sample(logits, rows, [0, 1, 2], [1, 2, None]), [1, 2])
    assert settled.accepted == (1,) and settled.token_ids == (0,)
    assert [lp.token_id for lp in settled.accepted_logprobs] == [1]


def speculative_sequences(drafts_of: list[int], seeds: range) -> torch.Tensor:
    """For each seed, the chain's first LENGTH tokens after token 0, drawn through verify
    steps that each propose `drafts_of` (cut to what is left), all sequences batched."""
    sampler = Sampler()
    sequences = {seed: [0] for seed in seeds}
    while any(len(s) <= LENGTH for s in sequences.values()):
        rows, positions, logits, spans = [], [], [], []
        for seed, tokens in sequences.items():
            if len(tokens) > LENGTH:
                continue
            drafts = drafts_of[: LENGTH + 1 - len(tokens) - 1]
            context = [tokens[-1], *drafts]
            position = len(tokens) - 1
            for offset, token in enumerate(context):
                rows.append(SamplingRow(1.0, 1.0, None, (seed,)))
                positions.append(position + offset)
                logits.append(CHAIN[token])
            spans.append((seed, drafts, len(context)))
        drawn = sampler.sample(
            torch.stack(logits),
            rows,
            positions,
            [d for _, drafts, _ in spans for d in [*drafts, None]],
        )
        at = 0
        for seed, drafts, count in spans:
            settled = settle(drawn[at : at + count], drafts)
            sequences[seed].extend([*settled.accepted, settled.token_ids[0]])
            at += count
    return torch.tensor([s[1 : LENGTH + 1] for s in sequences.values()])


def chi_square_p_value(sequences: torch.Tensor) -> float:
    """The p-value of the sequences' counts over all VOCAB**LENGTH outcomes against the
    chain's probabilities."""
    codes = (sequences * torch.tensor([VOCAB**2, VOCAB, 1])).sum(dim=1)
    observed = torch.bincount(codes, minlength=VOCAB**LENGTH).double()
    probs = CHAIN.double().exp()
    expected = torch.empty(VOCAB**LENGTH, dtype=torch.float64)
    for code in range(VOCAB**LENGTH):
        a, b, c = code // VOCAB**2, code // VOCAB % VOCAB, code % VOCAB
        expected[code] = probs[0, a] * probs[a, b] * probs[b, c]
    expected *= len(sequences)
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees = VOCAB**LENGTH - 1
    return torch.special.gammaincc(
        torch.tensor(degrees / 2, dtype=torch.float64), statistic / 2
    ).item()


@pytest.mark.parametrize("drafts", [[0, 0], [2, 2], [1, 2]], ids=["likely", "unlikely", "mixed"])
def test_sampled_verification_keeps_the_target_distribution(drafts):
    assert chi_square_p_value(speculative_sequences(drafts, range(SEQUENCES))) > 1e-3


def test_the_chi_square_test_rejects_a_skewed_sampler(monkeypatch):
    uniform = sampler_module._uniform
    monkeypatch.setattr(sampler_module, "_uniform", lambda seed: uniform(seed) ** 1.5)
    assert chi_square_p_value(speculative_sequences([0, 0], range(SEQUENCES))) < 1e-6


def test_a_sampled_row_accepts_a_likely_draft_more_often_than_an_unlikely_one():
    """Acceptance follows the draft's probability: over many seeds, p(0 | 0) = 0.6 and
    p(2 | 0) = 0.1 of the time."""
    rows = [SamplingRow(1.0, 1.0, None, (seed,)) for seed in range(4000)]
    logits = CHAIN[0].expand(len(rows), VOCAB)
    for draft, probability in ((0, 0.6), (2, 0.1)):
        drawn = Sampler().sample(logits, rows, [0] * len(rows), [draft] * len(rows))
        rate = sum(s.token_ids[0] == draft for s in drawn) / len(rows)
        assert abs(rate - probability) < 0.03
