"""Linear layers that know how they are split across tensor-parallel ranks.

Each parameter records how the full checkpoint tensor maps onto this rank (`shard_dim` plus the
sizes of the independently split sections along it), so the loader can slice any checkpoint
without knowing which layer it is filling. With `tp_size == 1` every layer is a plain linear.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridserve.kernels.cpu_gemm import can_pack, linear, pack_weight


@dataclass(frozen=True)
class ParallelContext:
    """Where this model replica sits in its tensor-parallel group."""

    tp_size: int = 1
    tp_rank: int = 0
    # Sums a row-parallel partial output over the group; required when tp_size > 1.
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside a group of {self.tp_size}")
        if self.tp_size > 1 and self.all_reduce is None:
            raise ValueError("tensor parallelism needs an all_reduce function")

    def split(self, size: int, what: str) -> int:
        if size % self.tp_size:
            raise ValueError(
                f"{what} ({size}) is not divisible by tensor_parallel_size {self.tp_size}"
            )
        return size // self.tp_size

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.all_reduce is None else self.all_reduce(partial)


def mark_shard(param: nn.Parameter, dim: int, sections: Sequence[int]) -> nn.Parameter:
    """Record that `param` holds this rank's 1/tp of each of `sections` (full sizes) along `dim`."""
    param.shard_dim = dim  # type: ignore[attr-defined]
    param.shard_sections = tuple(sections)  # type: ignore[attr-defined]
    return param


def shard_tensor(
    full: torch.Tensor, param: nn.Parameter, parallel: ParallelContext
) -> torch.Tensor:
    """The part of a full checkpoint tensor that belongs in `param` on this rank."""
    dim = getattr(param, "shard_dim", None)
    if dim is None or parallel.tp_size == 1:
        return full
    pieces = []
    offset = 0
    for section in param.shard_sections:  # type: ignore[attr-defined]
        local = section // parallel.tp_size
        pieces.append(full.narrow(dim, offset + parallel.tp_rank * local, local))
        offset += section
    return torch.cat(pieces, dim=dim)


def new_param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class PackableLinear(nn.Module):
    """A linear layer that may keep a CPU-packed copy of its weight for small batches."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """Call once the weights are final (after loading); a no-op where packing does not
        apply (GPU, non-float32)."""
        if can_pack(self.weight):
            self.packed = pack_weight(self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, self.weight, bias, self.packed)


class ColumnParallelLinear(PackableLinear):
    """y = x W^T (+ b) with W's output rows split across ranks, section by section.

    `out_sections` lists the full output sizes of sections that must each be split on their own
    (e.g. Mamba's in_proj = z | x | B | C | dt), so every rank gets a matching slice of each.
    """

    def __init__(
        self,
        in_features: int,
        out_sections: Sequence[int],
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
        name: str = "linear",
    ) -> None:
        super().__init__()
        self.out_sections = tuple(parallel.split(s, f"{name} output section") for s in out_sections)
        out_local = sum(self.out_sections)
        self.weight = mark_shard(
            new_param(out_local, in_features, dtype=dtype, device=device), 0, out_sections
        )
        self.bias = (
            mark_shard(new_param(out_local, dtype=dtype, device=device), 0, out_sections)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowParallelLinear(PackableLinear):
    """y = x W^T (+ b) with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
        name: str = "linear",
    ) -> None:
        super().__init__()
        self.parallel = parallel
        in_local = parallel.split(in_features, f"{name} input")
        self.weight = mark_shard(
            new_param(out_features, in_local, dtype=dtype, device=device), 1, [in_features]
        )
        self.bias = new_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.parallel.reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias


class ReplicatedLinear(PackableLinear):
    """A linear layer every rank holds in full (routers, latent projections, the LM head)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.weight = new_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = new_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)
