"""Sampler: greedy, filters, banned tokens, and per-(seed, position) reproducibility."""

from __future__ import annotations

import pytest
import torch

from hybridserve.workers.core.step_plan import SamplingRow, mix_seed
from hybridserve.workers.runner import sampler as sampler_module
from hybridserve.workers.runner.sampler import Sampler, prompt_logprobs

VOCAB = 50


def row(seed: int = 0, temperature: float = 1.0, top_p: float = 1.0, top_k=None, banned=(), **more):
    return SamplingRow(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seeds=(seed,),
        banned_token_ids=banned,
        **more,
    )


def draw(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    positions: list[int] | None = None,
) -> list[int]:
    """The one token each row draws (at token position 0 unless `positions` says)."""
    positions = positions or [0] * len(rows)
    return [sample.token_ids[0] for sample in sampler.sample(logits, rows, positions)]


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
    # Pinned: a seed is the same in every process and version (prefill and decode engines
    # draw a request's tokens alike).
    assert mix_seed(3, 5) == 7006590717180821281
    assert mix_seed(3, 5) != mix_seed(5, 3)
    assert mix_seed(-1, 0) != mix_seed(1, 0)
    assert mix_seed(2**64 + 7, 1) == mix_seed(7, 1)  # values are taken modulo 2**64


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 1.0, 0.0, 4.9], [-3.0, -2.0, -1.0, -0.5]])
    rows = [row(seed=i, temperature=0.0) for i in range(3)]
    assert draw(Sampler(), logits, rows) == [1, 0, 3]
    logits = random_logits(16)
    tokens = draw(Sampler(), logits, [row(temperature=0.0)] * 16)
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "asks",
    [
        {"seeds": (1, 2)},
        {"logit_bias": ((3, 100.0),)},
        {"banned_token_ids": (3,)},
        {"presence_penalty": 0.5, "output_token_ids": (3,)},
        {"frequency_penalty": 0.5, "output_token_ids": (3,)},
        {"repetition_penalty": 1.3, "prompt_token_ids": (3,)},
        {"allowed_token_bitmask": b"\x08" + bytes(7)},
        {"num_logprobs": 1},
    ],
)
def test_a_greedy_row_that_asks_more_than_the_argmax_is_not_plain(asks):
    """Plain greedy rows skip the sampler's work (their argmax is their token): every other
    control keeps a greedy row on the full path."""
    assert sampler_module.is_plain_greedy(row(temperature=0.0))
    assert not sampler_module.is_plain_greedy(row(temperature=0.5))
    fields = {"temperature": 0.0, "top_p": 1.0, "top_k": None, "seeds": (0,), **asks}
    greedy_with_more = SamplingRow(**fields)
    assert not sampler_module.is_plain_greedy(greedy_with_more)
    logits = random_logits(2)
    samples = Sampler().sample(logits, [row(temperature=0.0), greedy_with_more], [0, 0])
    assert samples[0].token_ids == (logits[0].argmax().item(),)
    assert samples[0].logprobs is None
    if "logit_bias" in asks or "allowed_token_bitmask" in asks:
        assert samples[1].token_ids[0] == 3  # the full path edited the row's logits


def test_sampling_does_not_modify_the_logits():
    logits = random_logits(2)
    before = logits.clone()
    draw(Sampler(), logits, [row(seed=1, banned=(3, 4)), row(seed=2, top_k=3, top_p=0.5)])
    assert torch.equal(logits, before)


def test_seeded_sampling_is_reproducible():
    logits = random_logits(1, seed=3)
    sampler = Sampler()
    for seed in range(10):
        first = draw(sampler, logits, [row(seed=mix_seed(seed, 0))])
        assert draw(sampler, logits, [row(seed=mix_seed(seed, 0))]) == first


def test_a_row_samples_the_same_token_alone_and_in_any_batch():
    logits = random_logits(6, seed=1)
    sampler = Sampler()
    for seed in range(30):
        target = row(seed=mix_seed(seed, 0), temperature=1.5)
        alone = draw(sampler, logits[2:3], [target])
        others = [row(seed=mix_seed(1000 + seed, i), temperature=0.7) for i in range(5)]
        batch_rows = [others[0], others[1], target, row(temperature=0.0), others[2], others[3]]
        assert draw(sampler, logits, batch_rows)[2] == alone[0]
        # Same row, same logits, now first in a batch of two.
        pair = torch.stack([logits[2], logits[0]])
        assert draw(sampler, pair, [target, others[4]])[0] == alone[0]


def test_different_positions_draw_differently():
    """With uniform logits the token is pure noise: positions of one request must not repeat
    one draw (the seed is mixed with the position)."""
    vocab = 1000
    logits = torch.zeros(1, vocab)
    sampler = Sampler()
    for request_seed in (0, 12345):
        tokens = [
            draw(sampler, logits, [row(seed=request_seed)], [position])[0]
            for position in range(200)
        ]
        # 200 uniform draws out of 1000 give about 181 distinct values.
        assert len(set(tokens)) >= 160
    # Two requests (seeds 7 and 8) do not share draws position by position either.
    seed_7 = [draw(sampler, logits, [row(seed=7)], [p])[0] for p in range(50)]
    seed_8 = [draw(sampler, logits, [row(seed=8)], [p])[0] for p in range(50)]
    assert sum(a == b for a, b in zip(seed_7, seed_8, strict=True)) <= 3


def test_top_k_1_equals_greedy():
    logits = random_logits(20, seed=2)
    rows = [row(seed=mix_seed(s, 0), temperature=2.0, top_k=1) for s in range(20)]
    assert draw(Sampler(), logits, rows) == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = random_logits(20, seed=4)
    rows = [row(seed=mix_seed(s, 0), temperature=2.0, top_p=1e-6) for s in range(20)]
    assert draw(Sampler(), logits, rows) == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_best_tokens():
    logits = torch.tensor([[2.0, 0.0, 1.0, 3.0, -1.0, 0.5]])
    sampler = Sampler()
    drawn = {draw(sampler, logits, [row(seed=mix_seed(s, 0), top_k=2)])[0] for s in range(300)}
    assert drawn == {0, 3}


def test_top_p_keeps_the_smallest_prefix_that_reaches_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    sampler = Sampler()
    counts = [0, 0, 0, 0]
    for s in range(2000):
        counts[draw(sampler, logits, [row(seed=mix_seed(s, 0), top_p=0.6)])[0]] += 1
    # 0.5 < 0.6, so token 1 is needed too; 0.5 + 0.3 >= 0.6, so tokens 2 and 3 are dropped.
    assert counts[2:] == [0, 0]
    # The kept two are renormalised: 5/8 and 3/8.
    assert chi_square(counts[:2], [5 / 8, 3 / 8]) < 10.83  # p = 0.001, 1 degree of freedom


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_banned_tokens_are_never_sampled(temperature):
    logits = torch.tensor([[10.0, 1.0, 0.0, 0.5, 9.0]])
    sampler = Sampler()
    drawn = {
        draw(sampler, logits, [row(seed=mix_seed(s, 0), temperature=temperature, banned=(0, 4))])[0]
        for s in range(300)
    }
    assert drawn == ({1} if temperature == 0.0 else {1, 2, 3})
    assert 0 not in drawn and 4 not in drawn


def test_banned_tokens_apply_to_their_own_row_only():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    rows = [row(temperature=0.0, banned=(1,)), row(temperature=0.0)]
    assert draw(Sampler(), logits, rows) == [2, 1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_distribution_matches_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    probs = torch.softmax(logits[0] / temperature, dim=-1).tolist()
    sampler = Sampler()
    counts = [0, 0, 0, 0]
    for s in range(4000):
        token = draw(sampler, logits, [row(seed=mix_seed(99, s), temperature=temperature)])[0]
        counts[token] += 1
    assert all(c > 0 for c in counts)
    assert chi_square(counts, probs) < 16.27  # p = 0.001, 3 degrees of freedom


# ---- logits processing: bias, masks, penalties, min-p, forks, logprobs -------------------


def reference_penalised(logits, output_ids, prompt_ids, presence, frequency, repetition):
    """vLLM's penalties, one token at a time (the oracle for the batched ones)."""
    result = logits.clone()
    seen = set(output_ids) | set(prompt_ids)
    for token in range(logits.shape[0]):
        value = result[token]
        if token in seen:
            value = value / repetition if value > 0 else value * repetition
        count = output_ids.count(token)
        value = value - frequency * count - presence * (count > 0)
        result[token] = value
    return result


def test_batched_penalties_equal_the_per_token_reference():
    logits = random_logits(4, vocab=12, seed=5)
    cases = [
        ((1, 1, 4), (2, 3), 0.5, 0.25, 1.0),
        ((5, 5, 5, 0), (), 0.0, 1.5, 1.3),
        ((), (7, 8, 8), -1.0, 0.0, 2.0),
        ((), (), 0.0, 0.0, 1.0),  # no penalty: untouched
    ]
    rows = [
        row(
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            output_token_ids=output,
            prompt_token_ids=prompt,
        )
        for output, prompt, presence, frequency, repetition in cases
    ]
    work = logits.clone()
    sampler_module._apply_penalties(work, rows)
    for i, (output, prompt, presence, frequency, repetition) in enumerate(cases):
        expected = reference_penalised(
            logits[i], list(output), prompt, presence, frequency, repetition
        )
        assert torch.allclose(work[i], expected, atol=1e-6), i
    # Through the sampler: a frequency penalty moves the greedy choice off a repeated token.
    best = int(logits[0].argmax())
    penalised = row(temperature=0.0, frequency_penalty=2.0, output_token_ids=(best,) * 5)
    assert draw(Sampler(), logits[:2], [penalised, row(temperature=0.0)]) == [
        int(reference_penalised(logits[0], [best] * 5, (), 0.0, 2.0, 1.0).argmax()),
        int(logits[1].argmax()),
    ]


def test_a_logit_bias_of_plus_100_forces_its_token_and_minus_100_bans_it():
    logits = random_logits(4, seed=6)
    forced = [row(seed=mix_seed(s, 0), logit_bias=((17, 100.0),)) for s in range(4)]
    assert draw(Sampler(), logits, forced) == [17] * 4
    best = logits.argmax(dim=-1).tolist()
    banned = [row(temperature=0.0, logit_bias=((b, -100.0),)) for b in best]
    assert all(t != b for t, b in zip(draw(Sampler(), logits, banned), best, strict=True))


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    drawn = {draw(Sampler(), logits, [row(seed=mix_seed(s, 0), min_p=0.5)])[0] for s in range(400)}
    assert drawn == {0, 1}  # 0.15 < 0.5 x 0.5


def test_the_structured_output_bitmask_allows_only_its_tokens():
    allowed = {3, 31, 32, 49}
    words = [0] * ((VOCAB + 31) // 32)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    mask = torch.tensor(words, dtype=torch.int64).to(torch.int32).numpy().tobytes()
    logits = random_logits(1, seed=8)
    for temperature in (0.0, 1.0):
        drawn = {
            draw(
                Sampler(),
                logits,
                [row(seed=mix_seed(s, 0), temperature=temperature, allowed_token_bitmask=mask)],
            )[0]
            for s in range(200)
        }
        assert drawn <= allowed and (temperature == 0.0 or len(drawn) > 1)


def test_a_row_with_several_seeds_draws_as_that_many_rows():
    logits = random_logits(2, seed=9)
    seeds = tuple(mix_seed(100 + i, 0) for i in range(5))
    fork = SamplingRow(temperature=1.0, top_p=0.9, top_k=None, seeds=seeds, num_logprobs=2)
    (sample, other) = Sampler().sample(logits, [fork, row(temperature=0.0)], [0, 0])
    alone = [draw(Sampler(), logits[:1], [row(seed=s, top_p=0.9)])[0] for s in seeds]
    assert list(sample.token_ids) == alone
    assert len(sample.logprobs) == 5 and other.token_ids == (int(logits[1].argmax()),)


def test_logprobs_are_the_raw_log_softmax_with_the_top_n_best_first():
    logits = random_logits(3, seed=10)
    rows = [
        row(temperature=0.0, num_logprobs=3),
        row(seed=1, temperature=0.7, num_logprobs=0, frequency_penalty=1.0, output_token_ids=(1,)),
        row(temperature=0.0),
    ]
    samples = Sampler().sample(logits, rows, [0] * len(rows))
    reference = torch.log_softmax(logits, dim=-1)
    for i in (0, 1):
        (entry,) = samples[i].logprobs
        assert abs(entry.logprob - reference[i, entry.token_id].item()) < 1e-5
    top = samples[0].logprobs[0].top
    assert [t for t, _ in top] == reference[0].topk(3).indices.tolist()
    assert all(abs(v - reference[0, t].item()) < 1e-5 for t, v in top)
    assert samples[1].logprobs[0].top == () and samples[2].logprobs is None


def test_prompt_logprobs_score_each_row_against_the_token_it_predicts():
    logits = random_logits(4, seed=11)
    scored = prompt_logprobs(logits, [5, 9, 2], num_top=2)
    reference = torch.log_softmax(logits, dim=-1)
    assert [s.token_id for s in scored] == [5, 9, 2]
    for i, entry in enumerate(scored):
        assert abs(entry.logprob - reference[i, entry.token_id].item()) < 1e-5
        assert [t for t, _ in entry.top] == reference[i].topk(2).indices.tolist()


@pytest.mark.parametrize(
    "filters",
    [
        {"top_p": 0.9},
        {"top_p": 0.5, "min_p": 0.05},
        {"top_k": 8},
        {"top_k": 8, "top_p": 0.8},
        {"top_k": 40, "top_p": 0.95},  # top-k above the candidates: every token is sorted
    ],
)
def test_filtered_rows_draw_the_same_from_candidates_as_from_a_full_sort(monkeypatch, filters):
    """A filtered row may work on its best CANDIDATES tokens only; the draws equal those
    of sorting the whole vocabulary, peaked rows (the candidates hold top_p) and flat rows
    (they do not) alike, in one batch."""
    generator = torch.Generator().manual_seed(5)
    scales = torch.tensor([6.0, 0.3, 4.0, 0.1, 8.0, 1.0])[:, None]
    logits = torch.randn(6, 400, generator=generator) * scales
    sampler = Sampler()
    for step in range(40):
        rows = [row(seed=mix_seed(s, step), temperature=0.9, **filters) for s in range(6)]
        monkeypatch.setattr(sampler_module, "CANDIDATES", 20)
        from_candidates = draw(sampler, logits, rows)
        monkeypatch.setattr(sampler_module, "CANDIDATES", 400)
        assert draw(sampler, logits, rows) == from_candidates
