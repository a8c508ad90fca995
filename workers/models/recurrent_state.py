"""Recurrent state as a family of kinds: what one recurrent layer keeps for one sequence.

Every recurrent layer kind (Mamba2, Gated DeltaNet, ...) describes its per-sequence state as a
few named tensors. The pools, live slots, snapshots, host tier, cache ops, transfer layouts and
the TP shard mapping read only this description, never the layer's own spec:

    Mamba2          conv       (x | B | C rows,  conv_kernel - 1)       rows split by heads / groups
                    ssm        (heads,            head_dim, state_size)  split by heads
    Mamba1          conv       (x rows,          conv_kernel - 1)       split by channels
                    ssm        (channels,         state_size)            split by channels
    Gated DeltaNet  conv       (q | k | v rows,  conv_kernel - 1)       split by key / value heads
                    recurrent  (value heads,      key_dim, value_dim)    split by value heads
    short conv      conv       (channels,         conv_kernel - 1)       split by channels

Tensor parallelism splits axis 0 of every tensor, section by section. A section is `size` rows
made of `units` indivisible units (heads, groups): with at least as many units as ranks each rank
holds 1/tp of the rows; with fewer, one whole unit, replicated over tp / units ranks (the units'
readers sit on those ranks). A pool holds, per slot, every recurrent layer's copy of a tensor:
(num_slots, num_recurrent_layers, local_rows, *row_shape), one contiguous region per slot.

Each tensor has a dtype role: `conv` tensors follow `conv_state_dtype` (default: the model's
dtype), `recurrent` ones `recurrent_state_dtype` (default float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

StateRole = Literal["conv", "recurrent"]


@dataclass(frozen=True)
class StateSection:
    """`size` rows along the split axis, made of `units` equal units that are never cut."""

    size: int
    units: int

    def held(self, tp_size: int, tp_rank: int = 0) -> tuple[int, int]:
        """(first row, rows) of this section on rank `tp_rank` of `tp_size`."""
        if self.units >= tp_size:
            rows = self.size // tp_size
            return tp_rank * rows, rows
        rows = self.size // self.units
        return tp_rank // (tp_size // self.units) * rows, rows


@dataclass(frozen=True)
class StateTensor:
    """One named state tensor of a layer: sections along axis 0, then `row_shape`."""

    name: str
    role: StateRole
    sections: tuple[StateSection, ...]
    row_shape: tuple[int, ...]

    @property
    def row_elements(self) -> int:
        return math.prod(self.row_shape)

    def local_rows(self, tp_size: int) -> int:
        return sum(section.held(tp_size)[1] for section in self.sections)

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """One layer's part of the tensor on one rank (every rank's has this shape)."""
        return (self.local_rows(tp_size), *self.row_shape)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The per-sequence state of one recurrent layer kind."""

    kind: str
    tensors: tuple[StateTensor, ...]

    def tensor(self, name: str) -> StateTensor:
        return next(t for t in self.tensors if t.name == name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)
