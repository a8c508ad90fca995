"""Vocabulary-parallel embedding and LM head.

Each rank holds a contiguous run of ceil(vocab / tp) vocabulary rows (the last rank's tail is
zero padding). The embedding looks up the ids that fall in its run, zeroes the others and
all-reduces; the LM head computes its run's logits and gathers them to rank 0, the one rank that
samples. Gathering only the rows that are sampled costs (rows x vocab) per step; replicating
the head instead would cost every rank the whole vocab x hidden weight and GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.linear import mark_shard, new_param


def vocab_param(
    vocab_size: int,
    hidden_size: int,
    parallel: ParallelContext,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> nn.Parameter:
    """This rank's (padded) rows of a (vocab, hidden) matrix."""
    first, _, padded = parallel.vocab_range(vocab_size)
    return mark_shard(
        new_param(padded, hidden_size, dtype=dtype, device=device), 0, [(first, padded)]
    )


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.first, self.num_real, _ = parallel.vocab_range(vocab_size)
        self.weight = vocab_param(vocab_size, hidden_size, parallel, dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_real)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.reduce(hidden.masked_fill(outside[:, None], 0.0))


def gather_logits(
    local: torch.Tensor, parallel: ParallelContext, vocab_size: int
) -> torch.Tensor | None:
    """(R, padded rows) on every rank -> (R, vocab) on rank 0; None on the others."""
    if parallel.tp_size == 1:
        return local
    assert parallel.collectives is not None
    parts = parallel.collectives.gather_to_driver(local.contiguous())
    return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]
