"""Depthwise causal conv1d over packed sequences, with the conv state kept in a slot pool.

The conv state of a sequence is its last W - 1 inputs (pre-conv, pre-activation), oldest first.
For one sequence of L tokens, with history h (the initial state) and inputs x:

    u = [ h_0 ... h_{W-2} | x_0 ... x_{L-1} ]
    out_t = act(bias + sum_k weight[:, k] * u[t + k])   the window u[t : t + W] ends at x_t
    state after pos tokens = u[pos : pos + W - 1]       still part history while pos < W - 1

Products and sums are float32; outputs are cast to x.dtype and states to the pool's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._common import positions_by_seq, read_slots, write_slots


@dataclass
class Conv1dOutput:
    out: torch.Tensor  # (T, C), dtype of x
    position_states: torch.Tensor | None  # (K, C, W - 1), conv_states.dtype; None if not requested


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    initial_state_slots: torch.Tensor,
    final_state_slots: torch.Tensor,
    activation: str | None = "silu",
    state_positions: torch.Tensor | None = None,
) -> Conv1dOutput:
    """Causal depthwise conv over S packed sequences, reading and writing conv states by slot.

    Shapes (T tokens in total, C channels, W kernel width):
        x: (T, C); weight: (C, W); bias: (C,)
        cu_seqlens: (S + 1,) cumulative token offsets; every sequence has at least one token
        conv_states: (num_slots, C, W - 1), written in place at `final_state_slots`
        initial_state_slots: (S,); -1 starts from a zero history
        final_state_slots: (S,); -1 skips writing the sequence's final state
        state_positions: (K, 2) rows (seq_index, pos) with 1 <= pos <= len(seq)

    Returns `out` (T, C) in x.dtype and, when `state_positions` is given, `position_states`
    (K, C, W - 1) in conv_states.dtype: the conv state after the first `pos` tokens of sequence
    `seq_index`. All initial states are read before any final state is written.
    """
    C = x.shape[1]
    W = weight.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    assert weight.shape == (C, W) and conv_states.shape[1:] == (C, W - 1)
    assert initial_state_slots.shape == (num_seqs,) and final_state_slots.shape == (num_seqs,)
    _check_activation(activation)

    histories = read_slots(conv_states, initial_state_slots).transpose(1, 2)  # (S, W - 1, C)
    offsets = cu_seqlens.tolist()
    positions = positions_by_seq(state_positions, offsets)
    xf = x.float()
    weight_f = weight.float()

    # Tap j (1 <= j < W) reads the input j tokens back. On the packed tokens that is x shifted
    # down by j rows, which is right everywhere except the first j tokens of each sequence:
    #     packed:   | a0 a1 a2 a3 | b0 b1 b2 |
    #     shift 2:  | .. .. a0 a1 | a2 a3 b0 |   b0, b1 must read b's history, not a2, a3
    # so add every tap over all rows at once, then correct those few rows.
    out = xf * weight_f[:, W - 1]
    rows, history_idx, wrong_rows, taps = [], [], [], []
    for j in range(1, W):
        out[j:].addcmul_(xf[:-j], weight_f[:, W - 1 - j])
        for s in range(num_seqs):
            start, end = offsets[s], offsets[s + 1]
            for i in range(min(j, end - start)):
                rows.append(start + i)
                history_idx.append((s, W - 1 - j + i))
                wrong_rows.append(start + i - j)  # -1 and below: nothing was added there
                taps.append(W - 1 - j)
    if rows:
        seq_idx, hist_col = zip(*history_idx, strict=True)
        wrong = torch.tensor(wrong_rows, device=x.device)
        wrong_x = torch.where((wrong >= 0)[:, None], xf[wrong.clamp(min=0)], 0.0)
        right = histories[list(seq_idx), list(hist_col)]
        tap_weights = weight_f[:, taps].t()  # (R, C)
        out.index_add_(0, torch.tensor(rows, device=x.device), tap_weights * (right - wrong_x))
    if bias is not None:
        out += bias.float()
    if activation == "silu":
        out = F.silu(out)

    def window(s: int, pos: int) -> torch.Tensor:
        """The conv state after `pos` tokens of sequence s: its last W - 1 inputs."""
        start = offsets[s]
        if pos >= W - 1:
            return xf[start + pos - (W - 1) : start + pos]
        return torch.cat([histories[s, pos:], xf[start : start + pos]])

    final_states = histories.new_empty((num_seqs, W - 1, C))
    for s in range(num_seqs):
        final_states[s] = window(s, offsets[s + 1] - offsets[s])
    num_positions = 0 if state_positions is None else state_positions.shape[0]
    position_states = histories.new_empty((num_positions, W - 1, C))
    for s in range(num_seqs):
        for row, pos in positions[s]:
            position_states[row] = window(s, pos)

    write_slots(conv_states, final_state_slots, final_states.transpose(1, 2))
    return Conv1dOutput(
        out=out.to(x.dtype),
        position_states=(
            None
            if state_positions is None
            else position_states.transpose(1, 2).to(conv_states.dtype)
        ),
    )


def causal_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token per row: convolve it with its slot's history, then shift it into the history.

    Shapes (Bt rows, C channels, W kernel width):
        x: (Bt, C); weight: (C, W); bias: (C,)
        conv_states: (num_slots, C, W - 1), updated in place (shift left, append x)
        state_slots: (Bt,); -1 marks a padding row
    Returns (Bt, C) in x.dtype. Padding rows leave the pool untouched and output zeros. Rows must
    use distinct slots.
    """
    Bt, C = x.shape
    W = weight.shape[1]
    assert weight.shape == (C, W) and conv_states.shape[1:] == (C, W - 1)
    assert state_slots.shape == (Bt,)
    _check_activation(activation)

    valid = state_slots >= 0
    all_valid = bool(valid.all())  # padding rows are rare: index only when there are some
    slots = (state_slots if all_valid else state_slots[valid]).long()
    num_valid = slots.shape[0]
    # As in the SSM state update: an ascending run of slots is updated through a view.
    first = int(slots[0]) if num_valid else 0
    run = torch.arange(first, first + num_valid, device=slots.device)
    in_pool = bool(torch.equal(slots, run)) and conv_states.dtype == torch.float32
    history = (
        conv_states[first : first + num_valid]
        if in_pool
        else conv_states.index_select(0, slots).float()
    )
    xf = (x if all_valid else x[valid]).float()
    weight_f = weight.float()
    y = xf * weight_f[:, W - 1]  # (b, C); the taps are added one by one (a size-3 reduction
    for k in range(W - 1):  # over the last dim is slow)
        y.addcmul_(history[:, :, k].float(), weight_f[:, k])
    if bias is not None:
        y += bias.float()
    if activation == "silu":
        y = F.silu(y)
    # Shift the window left by one and append the new input.
    shifted = torch.cat([history[:, :, 1:], xf[:, :, None]], dim=2)
    if in_pool:
        history.copy_(shifted)
    else:
        conv_states.index_copy_(0, slots, shifted.to(conv_states.dtype))

    if all_valid:
        return y.to(x.dtype)
    out = x.new_zeros((Bt, C))
    out[valid] = y.to(x.dtype)
    return out


def _check_activation(activation: str | None) -> None:
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
