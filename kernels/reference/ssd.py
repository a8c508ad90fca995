"""Mamba2 chunked scan (SSD) over packed variable-length sequences, in pure torch.

Per sequence and head h, starting from the state S_0 read from the pool:

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t)      S: (P, N)
    y_t = S_t @ C_t + D * x_t

The chunked (SSD) form splits each sequence into chunks of `chunk_size` tokens counted from the
sequence's first token; inside a chunk the recurrence becomes a masked quadratic form, and only
one state per chunk is carried from chunk to chunk. Everything is computed in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._common import (
    ChunkLayout,
    expand_groups,
    positions_by_seq,
    prepare_dt,
    read_slots,
    write_slots,
)


@dataclass
class ChunkScanOutput:
    out: torch.Tensor  # (T, H, P), dtype of x
    position_states: torch.Tensor | None  # (K, H, P, N), ssm_states.dtype; None if not requested


def mamba_chunk_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    initial_state_slots: torch.Tensor,
    final_state_slots: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    state_positions: torch.Tensor | None = None,
) -> ChunkScanOutput:
    """Run the Mamba2 scan over S packed sequences, reading and writing states in a slot pool.

    Shapes (T tokens in total, H heads, P head dim, G groups, N state size):
        x: (T, H, P)
        dt: (T, H), raw, before dt_bias and softplus
        A: (H,), negative
        B, C: (T, G, N); head h uses group h // (H // G)
        cu_seqlens: (S + 1,) cumulative token offsets; every sequence has at least one token
        ssm_states: (num_slots, H, P, N), written in place at `final_state_slots`
        initial_state_slots: (S,); -1 starts the sequence from a zero state
        final_state_slots: (S,); -1 skips writing the sequence's final state
        D: (H,); dt_bias: (H,)
        state_positions: (K, 2) rows (seq_index, pos) with 1 <= pos <= len(seq)

    Returns `out` (T, H, P) in x.dtype and, when `state_positions` is given, `position_states`
    (K, H, P, N) in ssm_states.dtype: row k is the state after the first `pos` tokens of sequence
    `seq_index`. Every initial state is read before any final state is written, so a slot may be
    both read and written in one call.
    """
    T, H, P = x.shape
    N = B.shape[-1]
    num_seqs = cu_seqlens.shape[0] - 1
    assert dt.shape == (T, H) and A.shape == (H,)
    assert B.shape[0] == T and C.shape == B.shape
    assert ssm_states.shape[1:] == (H, P, N)
    assert initial_state_slots.shape == (num_seqs,) and final_state_slots.shape == (num_seqs,)

    dt = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)
    xf, A, B, C = x.float(), A.float(), expand_groups(B, H), expand_groups(C, H)
    initial_states = read_slots(ssm_states, initial_state_slots)
    offsets = cu_seqlens.tolist()
    positions = positions_by_seq(state_positions, offsets)

    # All chunks of all sequences are processed together (ChunkLayout). A padded token has
    # dt = 0: no decay and no input, so it changes nothing.
    device = x.device
    # NOTE: any block length gives the same result up to rounding; the quadratic in-chunk work
    # grows with it, and on a CPU blocks of at most 64 tokens are fastest.
    chunk_size = min(chunk_size, 64)
    layout = ChunkLayout.of(cu_seqlens, chunk_size)
    first_chunk = layout.first_chunk
    y, final_states, state_after = _ssd_chunks(
        layout.to_chunks(xf),
        layout.to_chunks(dt[..., None])[..., 0],
        A,
        layout.to_chunks(B),
        layout.to_chunks(C),
        initial_states,
        layout.chunks_per_seq.tolist(),
        first_chunk.tolist(),
    )
    out = layout.to_tokens(y)
    if D is not None:
        out += D.float()[:, None] * xf

    position_states = None
    if state_positions is not None:
        rows = [row for seq in positions for row, _ in seq]
        seq_of_row = [s for s, seq in enumerate(positions) for _ in seq]
        pos = torch.tensor([p for seq in positions for _, p in seq], device=device) - 1
        k_idx = first_chunk[seq_of_row] + pos // chunk_size
        position_states = xf.new_empty((state_positions.shape[0], H, P, N))
        position_states[rows] = state_after(k_idx, pos % chunk_size)
        position_states = position_states.to(ssm_states.dtype)

    write_slots(ssm_states, final_state_slots, final_states)
    return ChunkScanOutput(out=out.to(x.dtype), position_states=position_states)


def _ssd_chunks(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_states: torch.Tensor,
    chunks_per_seq: list[int],
    first_chunk: list[int],
) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The chunked scan over K chunks of all sequences at once, float32, without the D term.

    x: (K, H, Q, P); dt: (K, H, Q) after softplus and clamp; A: (H,); B, C: (K, H, Q, N)
    expanded to heads; initial_states: (S, H, P, N); sequence s owns chunks
    [first_chunk[s], first_chunk[s] + chunks_per_seq[s]).
    Returns y (K, H, Q, P), each sequence's final state (S, H, P, N), and `state_after(k, l)`:
    the states after lanes l (R,) of chunks k (R,), (R, H, P, N).
    """
    # k = chunk, l (and s) = lane in chunk.
    # 1. Decay. dA_cumsum[k, l] = sum_{j <= l} dt_j * A is the log decay from the chunk start
    #    to lane l; decay[k, h, l, s] = exp(sum_{s < j <= l} dt_j * A) from lane s to lane l,
    #    zero for s > l (causality).
    dA = dt * A[:, None]
    dA_cumsum = dA.cumsum(dim=-1)  # (k, H, l)
    decay = torch.exp(_segsum(dA))  # (k, H, l, s)

    # 2. Intra-chunk output (diagonal blocks): y_l = sum_{s <= l} (C_l . B_s) decay[l, s] dt_s x_s.
    scores = C @ B.transpose(-1, -2)  # (k, H, l, s)
    scores.mul_(decay).mul_(dt[:, :, None, :])
    y = scores @ x  # (k, H, l, P)

    # 3. Each chunk's own contribution to the state at its end, as if it started from zero:
    #    states[k] = sum_s decay[last, s] dt_s outer(x_s, B_s).
    weights_to_end = decay[:, :, -1, :] * dt  # (k, H, s)
    states = (x * weights_to_end[..., None]).transpose(-1, -2) @ B  # (k, H, P, N)

    # 4. Inter-chunk recurrence inside each sequence, all sequences in step:
    #    start[first] = initial state;
    #    start[k + 1] = exp(dA_cumsum[k, last]) * start[k] + states[k].
    chunk_decay = torch.exp(dA_cumsum[:, :, -1])[:, :, None, None]  # (k, H, 1, 1)
    chunk_starts = torch.empty_like(states)
    current = initial_states.clone()
    for ordinal in range(max(chunks_per_seq, default=0)):
        seqs = [s for s, count in enumerate(chunks_per_seq) if count > ordinal]
        chunks = [first_chunk[s] + ordinal for s in seqs]
        if len(seqs) == 1:  # one sequence left (or a single long prompt): plain views
            (s,), (k,) = seqs, chunks
            chunk_starts[k] = current[s]
            current[s] = chunk_decay[k] * current[s] + states[k]
            continue
        seq_idx = torch.tensor(seqs, device=x.device)
        chunk_idx = torch.tensor(chunks, device=x.device)
        chunk_starts[chunk_idx] = current[seq_idx]
        current[seq_idx] = chunk_decay[chunk_idx] * current[seq_idx] + states[chunk_idx]

    # 5. Inter-chunk output (off-diagonal blocks): y_l += exp(dA_cumsum[l]) * (C_l @ start[k]).
    y += (C @ chunk_starts.transpose(-1, -2)) * torch.exp(dA_cumsum)[..., None]

    def state_after(k_idx: torch.Tensor, l_idx: torch.Tensor) -> torch.Tensor:
        """6. The state after lane l of chunk k: steps 3 and 4 with the chunk cut after lane l,
        exp(dA_cumsum[k, l]) * start[k] + sum_{s <= l} decay[l, s] dt_s x_s B_s^T."""
        weights = decay[k_idx, :, l_idx, :] * dt[k_idx]  # (R, H, s), zero for s > l
        partial = (x[k_idx] * weights[..., None]).transpose(-1, -2) @ B[k_idx]
        carried = torch.exp(dA_cumsum[k_idx, :, l_idx])[:, :, None, None] * chunk_starts[k_idx]
        return carried + partial

    return y, current, state_after


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """Segment sums: out[..., l, s] = sum_{s < k <= l} a[..., k] for l >= s, -inf for l < s.

    a: (..., Q) -> (..., Q, Q). Summing the segment directly, instead of subtracting two
    cumulative sums, keeps short segments accurate when the cumulative sums are large.
    """
    Q = a.shape[-1]
    tokens = a[..., :, None].expand(*a.shape, Q)  # tokens[..., k, s] = a[k]
    ones = torch.ones(Q, Q, dtype=torch.bool, device=a.device)
    segsum = tokens.masked_fill(~torch.tril(ones, diagonal=-1), 0).cumsum(dim=-2)
    return segsum.masked_fill(~torch.tril(ones), float("-inf"))
