"""RMSNorm as a module (the math lives in `hybridserve.kernels`)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import rms_norm
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.layers.linear import mark_shard, new_param


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SplitRMSNorm(nn.Module):
    """RMSNorm over a width that tensor parallelism splits (OLMo's q and k norms span every
    head's projection): each rank holds its `rows` (offset, length) of the `size` weights, and
    the sum of squares is summed over the ranks. Where each piece is held by `replicas` ranks
    (KV heads fewer than the ranks) the sum counts it that many times, so it is divided back."""

    def __init__(
        self,
        size: int,
        rows: tuple[int, int],
        replicas: int,
        eps: float,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.size, self.replicas, self.eps, self.parallel = size, replicas, eps, parallel
        self.weight = mark_shard(new_param(rows[1], dtype=dtype, device=device), 0, [rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (tokens, this rank's width)."""
        x32 = x.float()
        squares = x32.square().sum(-1, keepdim=True)
        if self.parallel.tp_size > 1:
            squares = self.parallel.reduce(squares) / self.replicas
        return (self.weight * (x32 * torch.rsqrt(squares / self.size + self.eps))).to(x.dtype)
