"""Token sampling: greedy, temperature, top-k, top-p, reproducible per (seed, position).

Each sampled row draws its noise from a generator seeded by the request's seed and the output
position, so a request yields the same tokens whatever else is in the batch, after a preemption,
or on another engine (disaggregated decode).
"""

from __future__ import annotations

import torch

from hybridserve.workers.step_plan import SamplingRow


class Sampler:
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """logits (R, V) float32 -> one token id per row."""
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                logits[i, list(row.banned_token_ids)] = float("-inf")
        tokens = logits.argmax(dim=-1).tolist()
        for i, row in enumerate(rows):
            if row.temperature > 0.0:
                tokens[i] = self._sample_row(logits[i], row)
        return tokens

    def _sample_row(self, logits: torch.Tensor, row: SamplingRow) -> int:
        logits = logits / row.temperature
        if row.top_k is not None and row.top_k < logits.shape[0]:
            threshold = logits.topk(row.top_k).values[-1]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        if row.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # Drop a token when the ones before it already reach top_p (the top token stays).
            drop = (cumulative - sorted_logits.softmax(dim=-1)) >= row.top_p
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
        generator = torch.Generator(device=probs.device).manual_seed(row.seed)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / noise).argmax())
