"""Low-rank adapters on a projection: y = W x + B (A x), A (rank x in) and B (out x rank).

Zamba2 gives each invocation of a shared block its own adapters on the block's shared q, k, v
and gate | up projections. Under tensor parallelism A is replicated (its output is `rank`
values per token) and B is split exactly as the projection it adds to, so each rank's term
lands on the rows of the projection it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridserve.workers.layers.linear import ColumnParallelLinear, ReplicatedLinear


class LowRankAdapter(nn.Module):
    def __init__(
        self,
        in_features: int,
        rank: int,
        out_rows: Sequence[tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        """`out_rows`: this rank's rows of the projection the adapter adds to."""
        super().__init__()
        self.down = ReplicatedLinear(in_features, rank, False, dtype, device)
        self.up = ColumnParallelLinear(rank, out_rows, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


@dataclass(frozen=True)
class QKVAdapters:
    """An attention's adapters, one per projection."""

    q: LowRankAdapter
    k: LowRankAdapter
    v: LowRankAdapter
