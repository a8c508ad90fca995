"""Sampler: greedy, filters, banned tokens, and per-(seed, position) reproducibility."""

from __future__ import annotations

import pytest
import torch

from hybridserve.workers.sampler import Sampler
from hybridserve.workers.step_plan import SamplingRow, mix_seed

VOCAB = 50


def row(seed: int = 0, temperature: float = 1.0, top_p: float = 1.0, top_k=None, banned=()):
    return SamplingRow(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, banned_token_ids=banned
    )


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=generator) * 2


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


def test_mix_seed_is_a_deterministic_63_bit_function_of_every_value_and_their_order():
    seeds = {mix_seed(s, p) for s in range(20) for p in range(50)}
    assert len(seeds) == 1000
    assert all(0 <= s < 2**63 for s in seeds)
    assert mix_seed(3, 5) == mix_seed(3, 5)
    assert mix_seed(3, 5) != mix_seed(5, 3)
    assert mix_seed(-1, 0) != mix_seed(1, 0)
    assert mix_seed(2**64 + 7, 1) == mix_seed(7, 1)  # values are taken modulo 2**64


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 1.0, 0.0, 4.9], [-3.0, -2.0, -1.0, -0.5]])
    rows = [row(seed=i, temperature=0.0) for i in range(3)]
    assert Sampler().sample(logits, rows) == [1, 0, 3]
    logits = random_logits(16)
    tokens = Sampler().sample(logits, [row(temperature=0.0)] * 16)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_sampling_does_not_modify_the_logits():
    logits = random_logits(2)
    before = logits.clone()
    Sampler().sample(logits, [row(seed=1, banned=(3, 4)), row(seed=2, top_k=3, top_p=0.5)])
    assert torch.equal(logits, before)


def test_seeded_sampling_is_reproducible():
    logits = random_logits(1, seed=3)
    sampler = Sampler()
    for seed in range(10):
        first = sampler.sample(logits, [row(seed=mix_seed(seed, 0))])
        assert sampler.sample(logits, [row(seed=mix_seed(seed, 0))]) == first


def test_a_row_samples_the_same_token_alone_and_in_any_batch():
    logits = random_logits(6, seed=1)
    sampler = Sampler()
    for seed in range(30):
        target = row(seed=mix_seed(seed, 0), temperature=1.5)
        alone = sampler.sample(logits[2:3], [target])
        others = [row(seed=mix_seed(1000 + seed, i), temperature=0.7) for i in range(5)]
        batch_rows = [others[0], others[1], target, row(temperature=0.0), others[2], others[3]]
        assert sampler.sample(logits, batch_rows)[2] == alone[0]
        # Same row, same logits, now first in a batch of two.
        pair = torch.stack([logits[2], logits[0]])
        assert sampler.sample(pair, [target, others[4]])[0] == alone[0]


def test_different_positions_draw_differently():
    """With uniform logits the token is pure noise: positions of one request must not repeat
    one draw (the seed is mixed with the position)."""
    vocab = 1000
    logits = torch.zeros(1, vocab)
    sampler = Sampler()
    for request_seed in (0, 12345):
        tokens = [
            sampler.sample(logits, [row(seed=mix_seed(request_seed, position))])[0]
            for position in range(200)
        ]
        # 200 uniform draws out of 1000 give about 181 distinct values.
        assert len(set(tokens)) >= 160
    # Two requests (seeds 7 and 8) do not share draws position by position either.
    seed_7 = [sampler.sample(logits, [row(seed=mix_seed(7, p))])[0] for p in range(50)]
    seed_8 = [sampler.sample(logits, [row(seed=mix_seed(8, p))])[0] for p in range(50)]
    assert sum(a == b for a, b in zip(seed_7, seed_8, strict=True)) <= 3


def test_top_k_1_equals_greedy():
    logits = random_logits(20, seed=2)
    rows = [row(seed=mix_seed(s, 0), temperature=2.0, top_k=1) for s in range(20)]
    assert Sampler().sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = random_logits(20, seed=4)
    rows = [row(seed=mix_seed(s, 0), temperature=2.0, top_p=1e-6) for s in range(20)]
    assert Sampler().sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_best_tokens():
    logits = torch.tensor([[2.0, 0.0, 1.0, 3.0, -1.0, 0.5]])
    sampler = Sampler()
    drawn = {sampler.sample(logits, [row(seed=mix_seed(s, 0), top_k=2)])[0] for s in range(300)}
    assert drawn == {0, 3}


def test_top_p_keeps_the_smallest_prefix_that_reaches_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    sampler = Sampler()
    counts = [0, 0, 0, 0]
    for s in range(2000):
        counts[sampler.sample(logits, [row(seed=mix_seed(s, 0), top_p=0.6)])[0]] += 1
    # 0.5 < 0.6, so token 1 is needed too; 0.5 + 0.3 >= 0.6, so tokens 2 and 3 are dropped.
    assert counts[2:] == [0, 0]
    # The kept two are renormalised: 5/8 and 3/8.
    assert chi_square(counts[:2], [5 / 8, 3 / 8]) < 10.83  # p = 0.001, 1 degree of freedom


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_banned_tokens_are_never_sampled(temperature):
    logits = torch.tensor([[10.0, 1.0, 0.0, 0.5, 9.0]])
    sampler = Sampler()
    drawn = {
        sampler.sample(logits, [row(seed=mix_seed(s, 0), temperature=temperature, banned=(0, 4))])[
            0
        ]
        for s in range(300)
    }
    assert drawn == ({1} if temperature == 0.0 else {1, 2, 3})
    assert 0 not in drawn and 4 not in drawn


def test_banned_tokens_apply_to_their_own_row_only():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    rows = [row(temperature=0.0, banned=(1,)), row(temperature=0.0)]
    assert Sampler().sample(logits, rows) == [2, 1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_distribution_matches_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    probs = torch.softmax(logits[0] / temperature, dim=-1).tolist()
    sampler = Sampler()
    counts = [0, 0, 0, 0]
    for s in range(4000):
        token = sampler.sample(logits, [row(seed=mix_seed(99, s), temperature=temperature)])[0]
        counts[token] += 1
    assert all(c > 0 for c in counts)
    assert chi_square(counts, probs) < 16.27  # p = 0.001, 3 degrees of freedom
