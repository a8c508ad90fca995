"""Token sampling over a batch of logits rows (docs/sampling.md).

Every control is a tensor operation over the whole batch: logit bias, banned tokens and the
structured-output mask are scattered in, penalties come from token-count tensors, and the
filters (top-k, top-p, min-p) work on one sort of the batch. The draw is inverse-CDF
sampling with one uniform number per row, derived from the request's seed mixed with the
position of the token drawn (its index in the request's tokens), so a request yields the same
tokens whatever else is in the batch, after a preemption, or on another engine (disaggregated
decode). The mixing happens here, for the rows that draw at random only: a greedy row's seed
is never looked at, and a request's row stays one value from step to step.

A row may carry several seeds (the n choices of a request fork at its prompt's last row): it
is expanded into one row per seed before anything else, so every draw is an ordinary row.

Logprobs are those of the raw model distribution (the log-softmax of the logits before any
processing), as vLLM returns by default.

Speculative decoding: a row may test a draft token. A greedy row's token is its argmax as
always; a sampled row accepts the draft with the probability its processed distribution p
gives it (one uniform number), and otherwise draws from p without the draft, renormalised
(a second one). Every proposer's draft is deterministic, so this is rejection sampling with a
one-hot proposal: the token that comes out is distributed as p, whatever the draft. The row's
token equals the draft exactly when it is accepted (speculative/verification.py).
"""

from __future__ import annotations

import torch

from hybridserve.workers.core.outputs import Sample, TokenLogprobs
from hybridserve.workers.core.step_plan import SamplingRow, mix_seed

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
_MASK64 = (1 << 64) - 1
# Best tokens a filtered row works on when its filters surely drop the rest (_draw_filtered).
CANDIDATES = 256


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        positions: list[int],
        drafts: list[int | None] | None = None,
    ) -> list[Sample]:
        """logits (R, V) float32, one row per SamplingRow -> one Sample per row. `positions`:
        per row, the index of the token it draws in its request's tokens. `drafts`: per row,
        the draft token it tests (None: none); only rows of one seed test one."""
        if all(is_plain_greedy(row) for row in rows):
            return greedy_samples(logits.argmax(dim=-1).tolist())
        counts = [len(row.seeds) for row in rows]
        # (row, its seed mixed with the position): the mixing costs a few microseconds in
        # Python, so it waits until a draw needs it.
        draws = [
            (row, seed, position)
            for row, position in zip(rows, positions, strict=True)
            for seed in row.seeds
        ]
        expanded = [row for row, _, _ in draws]
        if len(draws) > len(rows):
            source = torch.repeat_interleave(
                torch.arange(len(rows), device=logits.device),
                torch.tensor(counts, device=logits.device),
            )
            logits = logits.index_select(0, source)
        work = logits.to(torch.float32, copy=True)  # edited in place; `logits` stays raw
        _apply_bias_and_masks(work, expanded)
        _apply_penalties(work, expanded)
        tokens = work.argmax(dim=-1)
        # Per draw, the draft it tests: only rows of one seed test one (speculation starts
        # after the first token, where n > 1 forks).
        tested = [
            draft
            for draft, count in zip(drafts or [None] * len(rows), counts, strict=True)
            for _ in range(count)
        ]
        random = [
            i for i, (row, _, _) in enumerate(draws) if row.temperature > 0.0 and tested[i] is None
        ]
        if random:
            picked = torch.tensor(random, device=work.device)
            drawn = _draw(work[picked], [_seeded(draws[i]) for i in random])
            tokens[picked] = drawn
        verified = [
            i
            for i, (row, _, _) in enumerate(draws)
            if row.temperature > 0.0 and tested[i] is not None
        ]
        if verified:
            picked = torch.tensor(verified, device=work.device)
            tokens[picked] = _verify(
                work[picked],
                [_seeded(draws[i]) for i in verified],
                [tested[i] for i in verified],  # type: ignore[misc]
            )
        token_list = tokens.tolist()
        logprobs = _logprobs(logits, tokens, expanded)
        samples = []
        first = 0
        for row, count in zip(rows, counts, strict=True):
            span = slice(first, first + count)
            samples.append(
                Sample(
                    tuple(token_list[span]),
                    None if row.num_logprobs is None else tuple(logprobs[span]),  # type: ignore[index]
                )
            )
            first += count
        return samples


def _seeded(draw: tuple[SamplingRow, int, int]) -> tuple[SamplingRow, int]:
    """A draw's row and its seed mixed with the position of the token it draws."""
    row, seed, position = draw
    return row, mix_seed(seed, position)


def is_plain_greedy(row: SamplingRow) -> bool:
    """Whether the row's token is its logits' argmax and nothing else is asked of it: greedy,
    one choice, nothing that edits the logits, no logprobs."""
    return (
        row.temperature == 0.0
        and len(row.seeds) == 1
        and not row.logit_bias
        and not row.banned_token_ids
        and row.allowed_token_bitmask is None
        and not row.presence_penalty
        and not row.frequency_penalty
        and row.repetition_penalty == 1.0
        and row.num_logprobs is None
    )


def greedy_samples(token_ids: list[int]) -> list[Sample]:
    """The samples of plain greedy rows (`is_plain_greedy`) from their argmax tokens."""
    return [Sample((token_id,), None) for token_id in token_ids]


def _apply_bias_and_masks(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Logit bias, banned tokens (-inf) and the structured-output mask, in place."""
    vocab = work.shape[1]
    bias = [(i, t, b) for i, row in enumerate(rows) for t, b in row.logit_bias]
    if bias:
        index_rows, token_ids, values = zip(*bias, strict=True)
        work.index_put_(
            (torch.tensor(index_rows), torch.tensor(token_ids)),
            torch.tensor(values, dtype=work.dtype),
            accumulate=True,
        )
    banned = [(i, t) for i, row in enumerate(rows) for t in row.banned_token_ids]
    if banned:
        index_rows, token_ids = zip(*banned, strict=True)
        work[torch.tensor(index_rows), torch.tensor(token_ids)] = float("-inf")
    masked = [i for i, row in enumerate(rows) if row.allowed_token_bitmask is not None]
    if masked:
        words = torch.stack(
            [
                torch.frombuffer(bytearray(rows[i].allowed_token_bitmask), dtype=torch.int32)  # type: ignore[arg-type]
                for i in masked
            ]
        )
        allowed = ((words[:, :, None] >> _BIT_SHIFTS) & 1).bool().flatten(1)[:, :vocab]
        index = torch.tensor(masked)
        work[index] = work[index].masked_fill(~allowed.to(work.device), float("-inf"))


def _apply_penalties(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (prompt + output tokens), frequency and presence (output tokens), in place,
    for the rows that use them."""
    penalised = [
        i
        for i, row in enumerate(rows)
        if row.presence_penalty or row.frequency_penalty or row.repetition_penalty != 1.0
    ]
    if not penalised:
        return
    vocab = work.shape[1]
    index = torch.tensor(penalised, device=work.device)
    chosen = [rows[i] for i in penalised]
    output_counts = _token_counts([r.output_token_ids for r in chosen], vocab, work.device)
    prompt_counts = _token_counts([r.prompt_token_ids for r in chosen], vocab, work.device)
    logits = work[index]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]

    repetition = column([r.repetition_penalty for r in chosen])
    seen = (output_counts + prompt_counts) > 0
    penalised_logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised_logits, logits)
    logits = logits - column([r.frequency_penalty for r in chosen]) * output_counts
    logits = logits - column([r.presence_penalty for r in chosen]) * (output_counts > 0)
    work[index] = logits


def _token_counts(
    token_lists: list[tuple[int, ...]], vocab: int, device: torch.device
) -> torch.Tensor:
    """(rows, vocab) float counts of each row's token ids."""
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    width = max((len(t) for t in token_lists), default=0)
    if width:
        # Pad with a sink column (vocab) that is dropped afterwards.
        padded = torch.tensor(
            [list(t) + [vocab] * (width - len(t)) for t in token_lists], device=device
        )
        counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _draw(logits: torch.Tensor, draws: list[tuple[SamplingRow, int]]) -> torch.Tensor:
    """One token per row: temperature, then top-k, top-p and min-p (for the rows that use
    them), then inverse-CDF sampling with one uniform number per row from its seed.

    One number per row, not one per token: the draw costs a softmax, a cumulative sum and a
    binary search, whatever the vocabulary (seeded noise for every token of a 128k vocabulary
    cost ~3 ms a row on the CPU)."""
    rows = [row for row, _ in draws]
    device = logits.device
    temperature = torch.tensor([r.temperature for r in rows], device=device)[:, None]
    values = logits / temperature
    uniforms = torch.tensor([_uniform(seed) for _, seed in draws], dtype=torch.float64)
    tokens = torch.empty(len(rows), dtype=torch.int64, device=device)
    plain = [i for i, row in enumerate(rows) if not _filters(row)]
    if plain:
        tokens[plain] = _inverse_cdf(values[plain], uniforms[plain])
    filtered = [i for i, row in enumerate(rows) if _filters(row)]
    if filtered:
        tokens[filtered] = _draw_filtered(
            values[filtered], [rows[i] for i in filtered], uniforms[filtered]
        )
    return tokens


def _verify(
    logits: torch.Tensor, draws: list[tuple[SamplingRow, int]], drafts: list[int]
) -> torch.Tensor:
    """Per row: its draft if a uniform number from the row's seed falls below the draft's
    probability, else a draw (with a second uniform number) from the row's distribution
    without the draft."""
    rows = [row for row, _ in draws]
    probs = _filtered_probs(logits, rows)
    index = torch.tensor(drafts, device=probs.device)[:, None]
    draft_probs = probs.gather(1, index)[:, 0].double().cpu()
    accept = torch.tensor([_uniform(seed) for _, seed in draws], dtype=torch.float64)
    accepted = accept < draft_probs
    residual = probs.scatter(1, index, 0.0)
    # A draft of probability 1 is always accepted: its residual (all zeros) is never drawn.
    residual[accepted.to(residual.device)] = 1.0
    second = torch.tensor([_uniform(mix_seed(seed, 1)) for _, seed in draws], dtype=torch.float64)
    drawn = _inverse_cdf_probs(residual, second)
    return torch.where(accepted.to(drawn.device), index[:, 0], drawn)


def _filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's sampling distribution over the whole vocabulary: temperature, then top-k,
    top-p and min-p (as `_draw` applies them)."""
    temperature = torch.tensor([r.temperature for r in rows], device=logits.device)[:, None]
    values = logits / temperature
    filtered = [i for i, row in enumerate(rows) if _filters(row)]
    if filtered:
        sorted_values, order = values[filtered].sort(dim=-1, descending=True)
        kept = _filter_sorted(sorted_values, [rows[i] for i in filtered], None)
        values[filtered] = torch.full_like(kept, float("-inf")).scatter(1, order, kept)
    return values.softmax(dim=-1)


def _filters(row: SamplingRow) -> bool:
    return bool(row.top_k) or row.top_p < 1.0 or row.min_p > 0.0


def _draw_filtered(
    values: torch.Tensor, rows: list[SamplingRow], uniforms: torch.Tensor
) -> torch.Tensor:
    """Top-k, top-p and min-p work on logits sorted in descending order. Sorting the whole
    vocabulary is the slow part (3.6 ms for 32 rows of 4096 here), so a row whose filters
    surely drop everything below its best `CANDIDATES` works on those alone: its top-k is no
    larger, or it has no top-k and its candidates already hold top_p of the probability. The
    other rows sort everything. Either way the row's tokens are the same, so a row draws what
    it draws whatever else is in the batch."""
    vocab = values.shape[1]
    candidates, candidate_ids = values.topk(min(CANDIDATES, vocab), dim=-1)
    full_log_total = values.logsumexp(dim=-1, keepdim=True)
    top_k = torch.tensor([r.top_k or vocab for r in rows], device=values.device)
    top_p = torch.tensor([r.top_p for r in rows], device=values.device)
    no_top_k = top_k >= vocab
    mass = (candidates - full_log_total).exp().sum(dim=-1)
    fits = (top_k <= candidates.shape[1]) | (no_top_k & (top_p < 1.0) & (mass >= top_p))
    tokens = torch.empty(len(rows), dtype=torch.int64, device=values.device)
    for subset, candidates_only in ((fits, True), (~fits, False)):
        index = subset.nonzero()[:, 0]
        if index.numel() == 0:
            continue
        chosen = [rows[i] for i in index.tolist()]
        if candidates_only:
            sorted_values, order = candidates[index], candidate_ids[index]
            outside = torch.where(no_top_k[index, None], full_log_total[index], float("nan"))
        else:
            sorted_values, order = values[index].sort(dim=-1, descending=True)
            outside = None
        kept = _filter_sorted(sorted_values, chosen, outside)
        picked = _inverse_cdf(kept, uniforms[index.cpu()])
        tokens[index] = order.gather(1, picked[:, None])[:, 0]
    return tokens


def _filter_sorted(
    sorted_logits: torch.Tensor, rows: list[SamplingRow], full_log_total: torch.Tensor | None
) -> torch.Tensor:
    """Top-k, top-p and min-p on logits sorted in descending order: dropped tokens -> -inf.
    `full_log_total`: for candidates only, the log of the whole row's probability mass where
    top-p must be measured against it (rows without top-k; NaN elsewhere)."""
    device = sorted_logits.device
    width = sorted_logits.shape[1]
    ranks = torch.arange(width, device=device)[None, :]
    top_k = torch.tensor([r.top_k or width for r in rows], device=device)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    top_p = torch.tensor([r.top_p for r in rows], device=device)[:, None]
    if (top_p < 1.0).any():
        log_total = sorted_logits.logsumexp(dim=-1, keepdim=True)
        if full_log_total is not None:
            log_total = torch.where(full_log_total.isnan(), log_total, full_log_total)
        probs = (sorted_logits - log_total).exp()
        # Drop a token when the ones before it already reach top_p (the top token stays).
        drop = ((probs.cumsum(dim=-1) - probs) >= top_p) & (top_p < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    min_p = torch.tensor([r.min_p for r in rows], device=device)[:, None]
    if (min_p > 0.0).any():
        probs = sorted_logits.softmax(dim=-1)
        sorted_logits = sorted_logits.masked_fill(probs < min_p * probs[:, :1], float("-inf"))
    return sorted_logits


def _inverse_cdf(values: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the index drawn from softmax(values) by its uniform number."""
    return _inverse_cdf_probs(values.softmax(dim=-1), uniforms)


def _inverse_cdf_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the index drawn from `probs` (not necessarily normalised) by its uniform
    number."""
    cdf = probs.double().cumsum(dim=-1)
    thresholds = (uniforms.to(probs.device) * cdf[:, -1])[:, None]
    # The first index whose cumulative probability passes the threshold: index i is drawn
    # for thresholds in [cdf[i-1], cdf[i]), so with probability p_i, never one of p 0.
    picked = torch.searchsorted(cdf, thresholds, right=True)[:, 0]
    width = probs.shape[1]
    overflow = picked >= width  # u * total rounded up to total: the last index with p > 0
    if overflow.any():
        last = width - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        picked = torch.where(overflow, last, picked)
    return picked


def _uniform(seed: int) -> float:
    """A uniform number in [0, 1) from a row's seed (already mixed with the token's position,
    step_plan.mix_seed): splitmix64's finaliser once more, the top 53 bits."""
    state = (seed ^ 0x2545F4914F6CDD1D) * 0xBF58476D1CE4E5B9 & _MASK64
    state = (state ^ (state >> 27)) * 0x94D049BB133111EB & _MASK64
    state ^= state >> 31
    return (state >> 11) * 2.0**-53


def _logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]
) -> list[TokenLogprobs | None]:
    """Per expanded row that asked: the drawn token's raw logprob and the top N (`logits`:
    one raw row per expanded row)."""
    wanted = [i for i, row in enumerate(rows) if row.num_logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    index = torch.tensor(wanted, device=logits.device)
    raw = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = raw.gather(1, tokens[index][:, None])[:, 0].tolist()
    width = max(rows[i].num_logprobs or 0 for i in wanted)
    top_values, top_ids = raw.topk(min(width, raw.shape[1]), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    token_list = tokens.tolist()
    for position, i in enumerate(wanted):
        count = rows[i].num_logprobs or 0
        top = tuple(zip(top_ids[position][:count], top_values[position][:count], strict=True))
        result[i] = TokenLogprobs(token_list[i], chosen[position], top)
    return result


def prompt_logprobs(logits: torch.Tensor, targets: list[int], num_top: int) -> list[TokenLogprobs]:
    """Row i of `logits` scores `targets[i]` (the prompt token it predicts): its raw logprob
    and the top `num_top` of the row."""
    if not targets:
        return []
    raw = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    index = torch.tensor(targets, device=raw.device)[:, None]
    chosen = raw.gather(1, index)[:, 0].tolist()
    top: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if num_top:
        values, ids = raw.topk(min(num_top, raw.shape[1]), dim=-1)
        top = [
            tuple(zip(i, v, strict=True))
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        ]
    return [
        TokenLogprobs(token, logprob, best)
        for token, logprob, best in zip(targets, chosen, top, strict=True)
    ]
