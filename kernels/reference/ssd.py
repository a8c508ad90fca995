"""Mamba2 chunked scan (SSD) over packed variable-length sequences, in pure torch.

Per sequence and head h, starting from the state S_0 read from the pool:

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t)      S: (P, N)
    y_t = S_t @ C_t + D * x_t

The chunked (SSD) form splits each sequence into chunks of `chunk_size` tokens counted from the
sequence's first token; inside a chunk the recurrence becomes a masked quadratic form, and only
one state per chunk is carried from chunk to chunk. Everything is computed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import expand_groups, positions_by_seq, prepare_dt, read_slots, write_slots


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

    out = torch.empty_like(xf)
    final_states = torch.empty_like(initial_states)
    num_positions = 0 if state_positions is None else state_positions.shape[0]
    position_states = xf.new_empty((num_positions, H, P, N))
    for s in range(num_seqs):
        start, end = offsets[s], offsets[s + 1]
        rows = [k for k, _ in positions[s]]
        # The final state is the state after all end - start tokens; ask for it with the rest.
        pos = torch.tensor([end - start] + [p for _, p in positions[s]], device=x.device)
        y, states = _ssd_sequence(
            xf[start:end],
            dt[start:end],
            A,
            B[start:end],
            C[start:end],
            initial_states[s],
            chunk_size,
            pos,
        )
        out[start:end] = y
        final_states[s] = states[0]
        position_states[rows] = states[1:]
    if D is not None:
        out += D.float()[:, None] * xf

    write_slots(ssm_states, final_state_slots, final_states)
    return ChunkScanOutput(
        out=out.to(x.dtype),
        position_states=None if state_positions is None else position_states.to(ssm_states.dtype),
    )


def _ssd_sequence(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked scan of one sequence, all float32, without the D skip term.

    x: (L, H, P); dt: (L, H) after softplus and clamp; A: (H,); B, C: (L, H, N) already
    expanded to heads; initial_state: (H, P, N); positions: (K,) with 1 <= pos <= L.
    Returns y: (L, H, P) and the states after each requested position: (K, H, P, N).
    """
    L = x.shape[0]
    num_chunks = -(-L // chunk_size)
    # The zero padding sits after the last real token, so causality keeps it out of every real
    # output and every requested state.
    x, dt, B, C = (_pad_to_chunks(t, num_chunks, chunk_size) for t in (x, dt, B, C))
    # x: (c, l, H, P), dt: (c, l, H), B, C: (c, l, H, N); c = chunk, l (and s) = position in chunk

    # 1. Decay. dA_cumsum[c, l] = sum_{k <= l} dt_k * A is the log decay from the chunk start
    #    to token l; decay[c, h, l, s] = exp(sum_{s < k <= l} dt_k * A) from token s to token l,
    #    zero for s > l (causality).
    dA = dt * A
    dA_cumsum = dA.cumsum(dim=1)
    decay = torch.exp(_segsum(dA.transpose(1, 2)))  # (c, H, l, s)

    # 2. Intra-chunk output (diagonal blocks): y_l = sum_{s <= l} (C_l . B_s) decay[l, s] dt_s x_s.
    scores = torch.einsum("clhn,cshn->chls", C, B) * decay * dt.transpose(1, 2)[:, :, None, :]
    y_diag = torch.einsum("chls,cshp->clhp", scores, x)

    # 3. Each chunk's own contribution to the state at its end, as if it started from zero:
    #    states[c] = sum_s decay[last, s] dt_s outer(x_s, B_s).
    decay_to_end = decay[:, :, -1, :].transpose(1, 2)  # (c, s, H)
    states = torch.einsum("cshp,cshn->chpn", x * (decay_to_end * dt)[..., None], B)

    # 4. Inter-chunk recurrence: start[c + 1] = exp(dA_cumsum[c, last]) * start[c] + states[c].
    chunk_decay = torch.exp(dA_cumsum[:, -1, :])  # (c, H)
    starts = [initial_state]
    for c in range(num_chunks):
        starts.append(chunk_decay[c][:, None, None] * starts[-1] + states[c])
    chunk_starts = torch.stack(starts[:-1])  # (c, H, P, N)

    # 5. Inter-chunk output (off-diagonal blocks): y_l += exp(dA_cumsum[l]) * (start[c] @ C_l).
    y_off = torch.einsum("clhn,chpn->clhp", C, chunk_starts) * torch.exp(dA_cumsum)[..., None]
    y = (y_diag + y_off).reshape(num_chunks * chunk_size, *y_diag.shape[2:])[:L]

    # 6. State after `pos` tokens, whose last token sits at (c, l): steps 3 and 4 with chunk c cut
    #    after token l, exp(dA_cumsum[c, l]) * start[c] + sum_{s <= l} decay[l, s] dt_s x_s B_s^T.
    c_idx, l_idx = (positions - 1) // chunk_size, (positions - 1) % chunk_size
    weights = decay[c_idx, :, l_idx, :].transpose(1, 2) * dt[c_idx]  # (K, s, H), zero for s > l
    partial = torch.einsum("kshp,kshn->khpn", x[c_idx] * weights[..., None], B[c_idx])
    carried = torch.exp(dA_cumsum[c_idx, l_idx])[:, :, None, None] * chunk_starts[c_idx]
    return y, carried + partial


def _pad_to_chunks(t: torch.Tensor, num_chunks: int, chunk_size: int) -> torch.Tensor:
    """Zero-pad dim 0 of t: (L, ...) to num_chunks * chunk_size and split it: (c, l, ...)."""
    pad = num_chunks * chunk_size - t.shape[0]
    t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(num_chunks, chunk_size, *t.shape[1:])


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
