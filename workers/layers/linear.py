"""Linear layers that know how they are split across tensor-parallel ranks.

Each parameter records which parts of the full checkpoint tensor this rank holds (`shard_dim`
plus (offset, length) ranges along it), so the loader can slice any checkpoint without knowing
which layer it is filling. With `tp_size == 1` every layer is a plain linear.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybridserve.kernels import (
    can_pack,
    fp8_linear,
    linear,
    pack_weight,
    packed_linear,
    register_packed,
)
from hybridserve.workers.executors.parallel import ParallelContext

Ranges = tuple[tuple[int, int], ...]


def mark_shard(param: nn.Parameter, dim: int, ranges: Sequence[tuple[int, int]]) -> nn.Parameter:
    """Record that `param` holds, along `dim`, the (offset, length) `ranges` of the full
    checkpoint tensor, concatenated in order. Rows past the full tensor's end (vocabulary
    padding) load as zeros."""
    param.shard_dim = dim  # type: ignore[attr-defined]
    param.shard_ranges = tuple(ranges)  # type: ignore[attr-defined]
    return param


def split_ranges(sections: Sequence[int], parallel: ParallelContext) -> Ranges:
    """This rank's 1/tp of each of `sections` (full sizes laid end to end)."""
    ranges, offset = [], 0
    for size in sections:
        local = parallel.split(size, "section")
        ranges.append((offset + parallel.tp_rank * local, local))
        offset += size
    return tuple(ranges)


def section_ranges(sections: Sequence[tuple[tuple[int, int], int]]) -> Ranges:
    """This rank's rows of a tensor made of sections laid end to end: for each section, the
    (offset, length) this rank holds within it and the section's full size, e.g. Mamba2's
    in_proj z | x | B | C | dt, each cut for this rank on its own."""
    ranges, start = [], 0
    for (offset, length), size in sections:
        ranges.append((start + offset, length))
        start += size
    return tuple(ranges)


def shard_tensor(full: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """The part of a full checkpoint tensor that belongs in `param` on this rank."""
    dim = getattr(param, "shard_dim", None)
    if dim is None:
        return full
    pieces = [
        full.narrow(dim, offset, max(0, min(length, full.shape[dim] - offset)))
        for offset, length in param.shard_ranges  # type: ignore[attr-defined]
    ]
    # One piece is a view (no copy at TP 1, nor of a rank's contiguous rows).
    part = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
    missing = param.shape[dim] - part.shape[dim]
    if missing:
        padding = list(part.shape)
        padding[dim] = missing
        part = torch.cat([part, part.new_zeros(padding)], dim=dim)
    return part


def new_param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def fp8_parameters(module: nn.Module) -> tuple[str, ...]:
    """The parameters of `module` that may be held FP8 (their GEMMs take FP8)."""
    return getattr(module, "fp8_weights", ())


def hold_fp8(
    module: nn.Module, name: str, data: torch.Tensor, scale: torch.Tensor, group: int
) -> None:
    """Make parameter `name` of `module` the FP8 `data` with float32 `scale` per `group`
    columns (kernels/reference/linear.py), kept beside it as `{name}_scale` and
    `{name}_group`."""
    old = getattr(module, name)
    new = nn.Parameter(data, requires_grad=False)
    for attribute in ("shard_dim", "shard_ranges"):
        if hasattr(old, attribute):
            setattr(new, attribute, getattr(old, attribute))
    setattr(module, name, new)
    setattr(module, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
    setattr(module, f"{name}_group", group)


def packed_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, is_packed: bool
) -> torch.Tensor:
    """x weight^T + bias; `is_packed`: weight has a registered packed copy, which the
    `packed_linear` operator finds by its address."""
    if is_packed:
        return packed_linear(x, weight, bias)
    return linear(x, weight, bias)


class PackableLinear(nn.Module):
    """A linear layer that may keep a CPU-packed copy of its weight for small batches."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    # Whether `packed` exists: a flag the compiler reads (it cannot look at an opaque tensor).
    is_packed: bool = False
    fp8_weights = ("weight",)
    # An FP8 weight's scales and their group (hold_fp8); None for a float weight.
    weight_scale: nn.Parameter | None
    weight_group: int = 0

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("weight_scale", None)

    def pack_for_cpu(self) -> None:
        """Call once the weights are final (after loading); a no-op where packing does not
        apply (GPU, non-float32)."""
        if can_pack(self.weight):
            self.packed = pack_weight(self.weight)
            register_packed(self.weight, self.packed)
            self.is_packed = True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.weight_group, bias)
        return packed_matmul(x, self.weight, bias, self.is_packed)


class ColumnParallelLinear(PackableLinear):
    """y = x W^T (+ b) with W's output rows split across ranks.

    `out_rows` are this rank's (offset, length) ranges of the full output rows, e.g. one per
    section of Mamba's in_proj = z | x | B | C | dt, so every rank gets a matching slice of
    each (`split_ranges`), or a replicated KV head.
    """

    def __init__(
        self,
        in_features: int,
        out_rows: Sequence[tuple[int, int]],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        out_local = sum(length for _, length in out_rows)
        self.weight = mark_shard(
            new_param(out_local, in_features, dtype=dtype, device=device), 0, out_rows
        )
        self.bias = (
            mark_shard(new_param(out_local, dtype=dtype, device=device), 0, out_rows)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowParallelLinear(PackableLinear):
    """y = x W^T (+ b) with W's input columns split across ranks; partial sums are all-reduced.

    With `reduce=False` the output is this rank's partial sum (bias included on rank 0 only),
    for a caller that adds several partials before one all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        device: torch.device | str | None,
        name: str = "linear",
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.reduce = reduce
        in_local = parallel.split(in_features, f"{name} input")
        self.weight = mark_shard(
            new_param(out_features, in_local, dtype=dtype, device=device),
            1,
            [(parallel.tp_rank * in_local, in_local)],
        )
        self.bias = new_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, None)
        if self.reduce:
            out = self.parallel.reduce(out)
        elif not self.parallel.is_driver:
            return out  # the bias is added once, by rank 0's partial
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
