"""Depthwise causal conv1d over packed sequences, with the conv state kept in a slot pool.

Triton version of `kernels.reference.conv1d`; see its docstring for the state convention. For one
sequence with history h (its initial state, W - 1 inputs, oldest first) and inputs x:

    u = [ h_0 ... h_{W-2} | x_0 ... x_{L-1} ]      u[i + W - 1] = x_i
    out_i = act(bias + sum_k weight[:, k] * u[i + k])
    state after pos tokens = u[pos : pos + W - 1]

so tap k of token i reads x_{i + k - (W - 1)} when i + k >= W - 1 and h_{i + k} otherwise.

The varlen path is three launches on one stream, which is what orders "all initial states are
read before any final state is written" (a sequence may write the slot another one reads):

    1. _causal_conv1d_kernel         grid (token blocks, channel blocks)   reads x, pool -> out
    2. _conv_state_gather_kernel     grid (K + S, channel blocks)          reads x, pool -> states
       rows 0..K-1 are `state_positions`, rows K..K+S-1 the final states (pos = seq len)
    3. _conv_state_scatter_kernel    grid (S, channel blocks)              states -> pool
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.conv1d import Conv1dOutput
from .launch import strides

__all__ = ["Conv1dOutput", "causal_conv1d", "causal_conv1d_update"]


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit
def _causal_conv1d_kernel(
    # Pointers
    x,
    weight,
    bias,
    conv_states,
    cu_seqlens,
    seq_ids,
    initial_state_slots,
    out,
    # Dimensions
    T,
    C,
    # Strides
    stride_x_t,
    stride_x_c,
    stride_w_c,
    stride_w_k,
    stride_b_c,
    stride_s_slot,
    stride_s_c,
    stride_s_k,
    stride_o_t,
    stride_o_c,
    # Meta-parameters
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = o_t < T
    mask_c = o_c < C

    # A token block may straddle sequences: every token looks up its own sequence.
    b_seq = tl.load(seq_ids + o_t, mask=mask_t, other=0)
    b_start = tl.load(cu_seqlens + b_seq, mask=mask_t, other=0)
    b_slot = tl.load(initial_state_slots + b_seq, mask=mask_t, other=-1).to(tl.int64)
    b_i = o_t - b_start  # (BLOCK_T,) index of the token within its sequence
    o_t64 = o_t.to(tl.int64)

    b_acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(W):
        b_w = tl.load(weight + o_c * stride_w_c + k * stride_w_k, mask=mask_c, other=0.0)
        # Tap k reads u[i + k]: the packed input k - (W - 1) rows up, or the history.
        mask_x = mask_t & (b_i + k >= W - 1)
        p_x = x + (o_t64 + (k - (W - 1)))[:, None] * stride_x_t + o_c[None, :] * stride_x_c
        b_u = tl.load(p_x, mask=mask_x[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        if k < W - 1:
            # Only the first W - 1 - k tokens of a sequence reach into its history; slot -1
            # is a zero history.
            mask_h = mask_t & (b_i + k < W - 1) & (b_slot >= 0)
            p_h = (
                conv_states
                + b_slot[:, None] * stride_s_slot
                + o_c[None, :] * stride_s_c
                + (b_i + k)[:, None] * stride_s_k
            )
            b_h = tl.load(p_h, mask=mask_h[:, None] & mask_c[None, :], other=0.0)
            b_u += b_h.to(tl.float32)
        b_acc += b_u * b_w.to(tl.float32)[None, :]
    if HAS_BIAS:
        b_acc += tl.load(bias + o_c * stride_b_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    p_o = out + o_t64[:, None] * stride_o_t + o_c[None, :] * stride_o_c
    tl.store(p_o, b_acc.to(p_o.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _conv_state_gather_kernel(
    # Pointers
    x,
    conv_states,
    cu_seqlens,
    initial_state_slots,
    requests,
    states,
    # Dimensions
    C,
    # Strides
    stride_x_t,
    stride_x_c,
    stride_s_slot,
    stride_s_c,
    stride_s_k,
    stride_r_row,
    stride_r_col,
    stride_o_row,
    stride_o_c,
    stride_o_k,
    # Meta-parameters
    W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """states[row] = u[pos : pos + W - 1] of sequence seq, for requests[row] = (seq, pos)."""
    i_r, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_seq = tl.load(requests + i_r * stride_r_row)
    i_pos = tl.load(requests + i_r * stride_r_row + stride_r_col)
    i_start = tl.load(cu_seqlens + i_seq).to(tl.int64)
    i_slot = tl.load(initial_state_slots + i_seq).to(tl.int64)

    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    o_k = tl.arange(0, BLOCK_K)
    mask_c = o_c < C
    b_u = i_pos + o_k  # (BLOCK_K,) index into u of each state column
    mask_k = o_k < W - 1
    mask_x = mask_k & (b_u >= W - 1)
    p_x = x + (i_start + b_u - (W - 1))[None, :] * stride_x_t + o_c[:, None] * stride_x_c
    b_x = tl.load(p_x, mask=mask_c[:, None] & mask_x[None, :], other=0.0)
    # States are copies of inputs: x goes through float32 (as in the reference), so this is exact.
    b_s = b_x.to(tl.float32)  # (BLOCK_C, BLOCK_K); the history columns are 0 so far
    if i_slot >= 0:
        mask_h = mask_k & (b_u < W - 1)
        p_h = conv_states + i_slot * stride_s_slot + o_c[:, None] * stride_s_c
        p_h += b_u[None, :] * stride_s_k
        b_h = tl.load(p_h, mask=mask_c[:, None] & mask_h[None, :], other=0.0)
        b_s += b_h.to(tl.float32)
    p_o = states + i_r * stride_o_row + o_c[:, None] * stride_o_c + o_k[None, :] * stride_o_k
    tl.store(p_o, b_s.to(p_o.dtype.element_ty), mask=mask_c[:, None] & mask_k[None, :])


@triton.jit
def _conv_state_scatter_kernel(
    # Pointers
    states,
    final_state_slots,
    conv_states,
    # Dimensions
    C,
    # Strides
    stride_i_row,
    stride_i_c,
    stride_i_k,
    stride_s_slot,
    stride_s_c,
    stride_s_k,
    # Meta-parameters
    W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """conv_states[final_state_slots[s]] = states[s]; slot -1 is skipped."""
    i_s, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_slot = tl.load(final_state_slots + i_s).to(tl.int64)
    if i_slot < 0:
        return
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    o_k = tl.arange(0, BLOCK_K)
    mask = (o_c < C)[:, None] & (o_k < W - 1)[None, :]
    p_i = states + i_s * stride_i_row + o_c[:, None] * stride_i_c + o_k[None, :] * stride_i_k
    p_s = conv_states + i_slot * stride_s_slot + o_c[:, None] * stride_s_c
    p_s += o_k[None, :] * stride_s_k
    tl.store(p_s, tl.load(p_i, mask=mask), mask=mask)


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit
def _causal_conv1d_update_kernel(
    # Pointers
    x,
    weight,
    bias,
    conv_states,
    state_slots,
    out,
    # Dimensions
    C,
    # Strides
    stride_x_b,
    stride_x_c,
    stride_w_c,
    stride_w_k,
    stride_b_c,
    stride_s_slot,
    stride_s_c,
    stride_s_k,
    stride_slots_b,
    stride_o_b,
    stride_o_c,
    # Meta-parameters
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_b, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = o_c < C
    p_o = out + i_b * stride_o_b + o_c * stride_o_c
    i_slot = tl.load(state_slots + i_b * stride_slots_b).to(tl.int64)
    if i_slot < 0:
        # Skip padding rows: the pool is neither read nor written, the output is zero.
        tl.store(p_o, tl.zeros([BLOCK_C], dtype=p_o.dtype.element_ty), mask=mask_c)
        return

    b_x = tl.load(x + i_b * stride_x_b + o_c * stride_x_c, mask=mask_c, other=0.0)
    b_x = b_x.to(tl.float32)
    p_w = weight + o_c * stride_w_c
    b_acc = b_x * tl.load(p_w + (W - 1) * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
    p_s = conv_states + i_slot * stride_s_slot + o_c * stride_s_c
    # The window is u = [h_0 .. h_{W-2} | x]; the new state is u[1:]. Column k is read one step
    # before it is overwritten with column k + 1, by the thread that owns those channels.
    for k in tl.static_range(W - 1):
        b_h = tl.load(p_s + k * stride_s_k, mask=mask_c, other=0.0)
        b_acc += b_h.to(tl.float32) * tl.load(p_w + k * stride_w_k, mask=mask_c).to(tl.float32)
        if k > 0:
            tl.store(p_s + (k - 1) * stride_s_k, b_h, mask=mask_c)
    tl.store(p_s + (W - 2) * stride_s_k, b_x.to(p_s.dtype.element_ty), mask=mask_c)
    if HAS_BIAS:
        b_acc += tl.load(bias + o_c * stride_b_c, mask=mask_c, other=0.0).to(tl.float32)
    if SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    tl.store(p_o, b_acc.to(p_o.dtype.element_ty), mask=mask_c)


def _check_activation(activation: str | None) -> None:
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def _causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    initial_state_slots: torch.Tensor,
    final_state_slots: torch.Tensor,
    activation: str | None,
    state_positions: torch.Tensor | None,
) -> Conv1dOutput:
    T, C = x.shape
    W = weight.shape[1]
    S = cu_seqlens.shape[0] - 1
    assert W >= 2 and weight.shape == (C, W), weight.shape
    assert bias is None or bias.shape == (C,)
    assert conv_states.dim() == 3 and conv_states.shape[1:] == (C, W - 1), conv_states.shape
    assert initial_state_slots.shape == (S,) and final_state_slots.shape == (S,)
    assert state_positions is None or (
        state_positions.dim() == 2 and state_positions.shape[1] == 2
    ), state_positions.shape
    _check_activation(activation)
    # The kernels index these small int vectors with unit stride (a no-op when they already are).
    cu_seqlens = cu_seqlens.contiguous()
    initial_state_slots = initial_state_slots.contiguous()
    final_state_slots = final_state_slots.contiguous()

    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    K = 0 if state_positions is None else state_positions.shape[0]
    # Rows 0..K-1: the requested positions; rows K..K+S-1: the final states.
    states = torch.empty((K + S, C, W - 1), dtype=conv_states.dtype, device=x.device)
    position_states = None if state_positions is None else states[:K]
    if S == 0:
        return Conv1dOutput(out=out, position_states=position_states)

    # NOTE: per-token sequence ids, built without a host sync (output_size is known).
    seq_lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_range = torch.arange(S, dtype=torch.int32, device=x.device)
    seq_ids = torch.repeat_interleave(seq_range, seq_lens, output_size=T)
    final_requests = torch.stack([seq_range, seq_lens.to(torch.int32)], dim=1)
    requests = (
        final_requests
        if state_positions is None
        else torch.cat([state_positions.to(torch.int32), final_requests])
    )

    BLOCK_T = 32
    BLOCK_C = min(triton.next_power_of_2(C), 128)
    BLOCK_K = triton.next_power_of_2(W - 1)
    num_c_blocks = triton.cdiv(C, BLOCK_C)
    if T > 0:
        _causal_conv1d_kernel[(triton.cdiv(T, BLOCK_T), num_c_blocks)](
            x=x,
            weight=weight,
            bias=bias,
            conv_states=conv_states,
            cu_seqlens=cu_seqlens,
            seq_ids=seq_ids,
            initial_state_slots=initial_state_slots,
            out=out,
            T=T,
            C=C,
            **strides("x", x, "t", "c"),
            **strides("w", weight, "c", "k"),
            **strides("b", bias, "c"),
            **strides("s", conv_states, "slot", "c", "k"),
            **strides("o", out, "t", "c"),
            W=W,
            SILU=activation == "silu",
            BLOCK_T=BLOCK_T,
            BLOCK_C=BLOCK_C,
        )
    _conv_state_gather_kernel[(K + S, num_c_blocks)](
        x=x,
        conv_states=conv_states,
        cu_seqlens=cu_seqlens,
        initial_state_slots=initial_state_slots,
        requests=requests,
        states=states,
        C=C,
        **strides("x", x, "t", "c"),
        **strides("s", conv_states, "slot", "c", "k"),
        **strides("r", requests, "row", "col"),
        **strides("o", states, "row", "c", "k"),
        W=W,
        BLOCK_C=BLOCK_C,
        BLOCK_K=BLOCK_K,
    )
    # Only now, after every read of the pool above, are final states written.
    _conv_state_scatter_kernel[(S, num_c_blocks)](
        states=states[K:],
        final_state_slots=final_state_slots,
        conv_states=conv_states,
        C=C,
        **strides("i", states, "row", "c", "k"),
        **strides("s", conv_states, "slot", "c", "k"),
        W=W,
        BLOCK_C=BLOCK_C,
        BLOCK_K=BLOCK_K,
    )
    return Conv1dOutput(out=out, position_states=position_states)


def causal_conv1d(
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

    Shapes (T tokens in total, C channels, W kernel width, 2 <= W):
        x: (T, C); weight: (C, W); bias: (C,)
        cu_seqlens: (S + 1,) int, contiguous, cumulative token offsets; every sequence has at
            least one token and cu_seqlens[S] == T
        conv_states: (num_slots, C, W - 1), any strides (e.g. `pool[:, layer]`), written in
            place at `final_state_slots`
        initial_state_slots: (S,) int; -1 starts from a zero history
        final_state_slots: (S,) int; -1 skips writing the sequence's final state; the slots
            that are written must be distinct
        state_positions: (K, 2) int rows (seq_index, pos) with 1 <= pos <= len(seq)

    Returns `out` (T, C) in x.dtype and, when `state_positions` is given, `position_states`
    (K, C, W - 1) in conv_states.dtype: the conv state after the first `pos` tokens of sequence
    `seq_index`. All initial states are read before any final state is written.

    Unlike the reference, nothing here waits on the device: cu_seqlens and state_positions are
    trusted, not validated (out-of-range positions read garbage instead of raising).
    """
    return _causal_conv1d_fwd(
        x,
        weight,
        bias,
        cu_seqlens,
        conv_states,
        initial_state_slots,
        final_state_slots,
        activation,
        state_positions,
    )


def _causal_conv1d_update_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    Bt, C = x.shape
    W = weight.shape[1]
    assert W >= 2 and weight.shape == (C, W), weight.shape
    assert bias is None or bias.shape == (C,)
    assert conv_states.dim() == 3 and conv_states.shape[1:] == (C, W - 1), conv_states.shape
    assert state_slots.shape == (Bt,) and not state_slots.is_floating_point()
    _check_activation(activation)

    out = torch.empty((Bt, C), dtype=x.dtype, device=x.device)
    if Bt == 0:
        return out
    BLOCK_C = min(triton.next_power_of_2(C), 128)
    _causal_conv1d_update_kernel[(Bt, triton.cdiv(C, BLOCK_C))](
        x=x,
        weight=weight,
        bias=bias,
        conv_states=conv_states,
        state_slots=state_slots,
        out=out,
        C=C,
        **strides("x", x, "b", "c"),
        **strides("w", weight, "c", "k"),
        **strides("b", bias, "c"),
        **strides("s", conv_states, "slot", "c", "k"),
        **strides("slots", state_slots, "b"),
        **strides("o", out, "b", "c"),
        W=W,
        SILU=activation == "silu",
        BLOCK_C=BLOCK_C,
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token per row: convolve it with its slot's history, then shift it into the history.

    Shapes (Bt rows, C channels, W kernel width, 2 <= W):
        x: (Bt, C); weight: (C, W); bias: (C,)
        conv_states: (num_slots, C, W - 1), any strides, updated in place (shift left, append x)
        state_slots: (Bt,) int; -1 marks a padding row
    Returns (Bt, C) in x.dtype. Padding rows leave the pool untouched and output zeros. Rows must
    use distinct slots.
    """
    return _causal_conv1d_update_fwd(x, weight, bias, conv_states, state_slots, activation)
