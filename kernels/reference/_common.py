"""Helpers shared by the Mamba reference kernels: dt, state-pool slots, requested positions.

A state pool is a tensor whose first dimension indexes slots (`slot` = one Mamba state entry).
Every kernel addresses it through an int tensor of slot ids where `-1` means "no slot".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def prepare_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """Return dt' = clamp(softplus(dt + dt_bias), *dt_limit) in float32.

    dt: (..., H); dt_bias: (H,). The softplus is skipped when `dt_softplus` is False.
    """
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def expand_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """Repeat B or C from groups to heads in float32: head h reads group h // (H // G).

    t: (..., G, N) -> (..., H, N).
    """
    ngroups = t.shape[-2]
    assert nheads % ngroups == 0, f"nheads {nheads} is not a multiple of n_groups {ngroups}"
    return t.float().repeat_interleave(nheads // ngroups, dim=-2)


def read_slots(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy the states of `slots` out of `pool` as float32; slot -1 reads a zero state.

    pool: (num_slots, *state_shape); slots: (S,) -> (S, *state_shape). The result is a copy, so
    callers may write the pool afterwards without changing what they read.
    """
    states = pool.new_zeros((slots.shape[0], *pool.shape[1:]), dtype=torch.float32)
    valid = slots >= 0
    states[valid] = pool.index_select(0, slots[valid].long()).float()
    return states


def write_slots(pool: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Write `states` into `pool` at `slots` (cast to the pool's dtype); slot -1 is skipped.

    pool: (num_slots, *state_shape); slots: (S,); states: (S, *state_shape).
    """
    valid = slots >= 0
    pool.index_copy_(0, slots[valid].long(), states[valid].to(pool.dtype))


def positions_by_seq(
    state_positions: torch.Tensor | None, offsets: list[int]
) -> list[list[tuple[int, int]]]:
    """Group the rows of `state_positions` by sequence: [[(row, pos), ...] per sequence]."""
    by_seq: list[list[tuple[int, int]]] = [[] for _ in range(len(offsets) - 1)]
    if state_positions is None:
        return by_seq
    for row, (seq, pos) in enumerate(state_positions.tolist()):
        if not 0 <= seq < len(by_seq):
            raise ValueError(f"state_positions row {row}: no sequence {seq}")
        seq_len = offsets[seq + 1] - offsets[seq]
        if not 1 <= pos <= seq_len:
            raise ValueError(
                f"state_positions row {row}: pos {pos} is outside [1, {seq_len}] of sequence {seq}"
            )
        by_seq[seq].append((row, pos))
    return by_seq


@dataclass(frozen=True)
class ChunkLayout:
    """Packed sequences cut into chunks of `chunk_size` tokens, each from its sequence's first
    token, every chunk of every sequence side by side (zero-padded at the end of each
    sequence's last chunk):

        packed tokens:  | s0 s0 s0 s0 s0 | s1 s1 |
        chunks (Q=4):   | s0 s0 s0 s0 | s0 __ __ __ | s1 s1 __ __ |

    Token t sits at lane `lane_ids[t]` of chunk `chunk_ids[t]`; sequence s owns chunks
    [first_chunk[s], first_chunk[s] + chunks_per_seq[s])."""

    chunk_size: int
    chunk_ids: torch.Tensor  # (T,)
    lane_ids: torch.Tensor  # (T,)
    chunks_per_seq: torch.Tensor  # (S,)
    first_chunk: torch.Tensor  # (S,)
    num_chunks: int

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, chunk_size: int) -> ChunkLayout:
        device = cu_seqlens.device
        lengths = cu_seqlens.diff().long()
        chunks_per_seq = (lengths + chunk_size - 1) // chunk_size
        first_chunk = torch.cumsum(chunks_per_seq, 0) - chunks_per_seq
        seq_ids = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), lengths)
        num_tokens = int(lengths.sum())
        pos_in_seq = torch.arange(num_tokens, device=device) - cu_seqlens[seq_ids].long()
        return cls(
            chunk_size,
            first_chunk[seq_ids] + pos_in_seq // chunk_size,
            pos_in_seq % chunk_size,
            chunks_per_seq,
            first_chunk,
            int(chunks_per_seq.sum()),
        )

    def to_chunks(self, t: torch.Tensor) -> torch.Tensor:
        """(T, H, ...) packed -> (K, H, Q, ...) chunked, head-major so per-chunk products are
        plain batched matmuls."""
        chunked = t.new_zeros((self.num_chunks, t.shape[1], self.chunk_size, *t.shape[2:]))
        chunked[self.chunk_ids, :, self.lane_ids] = t
        return chunked

    def to_tokens(self, chunked: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_chunks`: (K, H, Q, ...) -> (T, H, ...)."""
        return chunked[self.chunk_ids, :, self.lane_ids]
