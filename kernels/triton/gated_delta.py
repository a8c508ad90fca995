"""The gated delta rule (Gated DeltaNet, Kimi Delta Attention) in Triton: the chunked prompt
form and the decode step.

Triton twins of `kernels.reference.gated_delta` (same arguments, same float32 math; see its
docstring for the recurrence and the chunked WY form).

Prompt (`gated_delta_chunk`): one program per (sequence, value head, block of BLOCK_V value
columns) walks its sequence chunk by chunk (64 tokens), carrying the (Dk, BLOCK_V) state in
registers. Per chunk it builds A = strictly_lower((beta k) k^T * exp(G_i - G_j)) and inverts the
unit lower-triangular I + A by forward substitution, one row at a time in registers.

NOTE: the product form (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^32) (A is nilpotent)
would be ten matrix products instead of 63 row steps, but its partial products grow like
binomial coefficients when keys repeat, beta is near 1 and there is little decay (entries of
A near 1): float32 loses everything there (tests/kernels/triton/test_gated_delta.py, aligned
keys). Substitution computes the inverse itself, whose entries stay bounded. Every matrix
product runs in full float32 (`input_precision="ieee"`: TF32 would lose the exactness the
reuse tests rely on).

With per-channel decay (Kimi Delta Attention, g of (T, Hv, Dk)) the prompt runs the recurrence
token by token instead (`_scan_kernel`), the state block in registers for the whole sequence.

Decode (`gated_delta_step`): one program per (row, value head, block of value columns) reads its
(Dk, BLOCK_V) part of the state from the slot pool, advances it one token in place, and writes
that block of the output. Padding rows (slot -1) leave the pool untouched and output zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import strides

CHUNK = 64
L2_EPS = tl.constexpr(1e-6)


@triton.jit
def _decay(p_g, stride_g_d, o_k, mask_k, PER_CHANNEL: tl.constexpr):
    """exp(g) as a (BLOCK_K, 1) column: one value per key channel, or the head's for every row."""
    if PER_CHANNEL:
        b_g = tl.load(p_g + o_k * stride_g_d, mask=mask_k, other=0.0).to(tl.float32)
    else:
        b_g = tl.load(p_g + o_k * 0).to(tl.float32)  # the head's decay on every row
    return tl.exp(b_g)[:, None]


@triton.jit
def _normalised(x, scale):
    """Rows of x (tokens, BLOCK_K) L2-normalised (zero padding columns add nothing), * scale."""
    return x * (scale / tl.sqrt(tl.sum(x * x, axis=1) + L2_EPS))[:, None]


@triton.jit
def _chunk_kernel(
    q,
    k,
    v,
    g,
    beta,
    out,
    states,
    cu_seqlens,
    initial_slots,
    final_slots,
    Dk,
    Dv,
    value_per_key,
    q_scale,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_g_t,
    stride_g_h,
    stride_beta_t,
    stride_beta_h,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_s_slot,
    stride_s_h,
    stride_s_k,
    stride_s_v,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i_s, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // value_per_key
    start = tl.load(cu_seqlens + i_s).to(tl.int64)
    end = tl.load(cu_seqlens + i_s + 1).to(tl.int64)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    o_c = tl.arange(0, CHUNK_SIZE)
    mask_k, mask_v = o_k < Dk, o_v < Dv
    mask_s = mask_k[:, None] & mask_v[None, :]
    lower = o_c[:, None] >= o_c[None, :]
    strictly_lower = o_c[:, None] > o_c[None, :]
    identity = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)

    first = tl.load(initial_slots + i_s).to(tl.int64)
    p_state = o_k[:, None] * stride_s_k + o_v[None, :] * stride_s_v + i_h * stride_s_h
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    if first >= 0:
        state = tl.load(states + first * stride_s_slot + p_state, mask=mask_s, other=0.0)
        state = state.to(tl.float32)

    for chunk_start in range(start, end, CHUNK_SIZE):
        t = chunk_start + o_c
        mask_t = t < end
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        b_q = tl.load(
            q + t[:, None] * stride_q_t + i_kh * stride_q_h + o_k[None, :] * stride_q_d,
            mask=mask_tk,
            other=0.0,
        ).to(tl.float32)
        b_k = tl.load(
            k + t[:, None] * stride_k_t + i_kh * stride_k_h + o_k[None, :] * stride_k_d,
            mask=mask_tk,
            other=0.0,
        ).to(tl.float32)
        b_v = tl.load(
            v + t[:, None] * stride_v_t + i_h * stride_v_h + o_v[None, :] * stride_v_d,
            mask=mask_tv,
            other=0.0,
        ).to(tl.float32)
        # Padded lanes: g = 0 (no decay) and beta = 0 (no correction) change nothing.
        b_g = tl.load(g + t * stride_g_t + i_h * stride_g_h, mask=mask_t, other=0.0)
        b_beta = tl.load(beta + t * stride_beta_t + i_h * stride_beta_h, mask=mask_t, other=0.0)
        b_g, b_beta = b_g.to(tl.float32), b_beta.to(tl.float32)
        b_q = _normalised(b_q, q_scale)
        b_k = _normalised(b_k, 1.0)

        G = tl.cumsum(b_g, axis=0)
        decay = tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))
        k_beta = b_k * b_beta[:, None]
        A = tl.dot(k_beta, tl.trans(b_k), input_precision="ieee") * decay
        A = tl.where(strictly_lower, A, 0.0)
        # T = (I + A)^-1 by forward substitution, row by row: T_i = e_i - sum_{j<i} A_ij T_j.
        T = identity
        for i in range(1, CHUNK_SIZE):
            a_i = tl.sum(tl.where(o_c[:, None] == i, A, 0.0), axis=0)  # row i of A
            t_i = tl.where(o_c == i, 1.0, -tl.sum(a_i[:, None] * T, axis=0))
            T = tl.where(o_c[:, None] == i, t_i[None, :], T)
        u = tl.dot(T, b_v * b_beta[:, None], input_precision="ieee")
        w = tl.dot(T, k_beta * tl.exp(G)[:, None], input_precision="ieee")
        corrected = u - tl.dot(w, state, input_precision="ieee")
        attention = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * decay
        b_o = tl.dot(b_q * tl.exp(G)[:, None], state, input_precision="ieee")
        b_o += tl.dot(attention, corrected, input_precision="ieee")
        tl.store(
            out + t[:, None] * stride_o_t + i_h * stride_o_h + o_v[None, :] * stride_o_d,
            b_o.to(out.dtype.element_ty),
            mask=mask_tv,
        )
        G_last = tl.sum(b_g, axis=0)
        k_to_end = b_k * tl.exp(G_last - G)[:, None]
        state = state * tl.exp(G_last) + tl.dot(
            tl.trans(k_to_end), corrected, input_precision="ieee"
        )

    last = tl.load(final_slots + i_s).to(tl.int64)
    if last >= 0:
        p_last = states + last * stride_s_slot + p_state
        tl.store(p_last, state.to(states.dtype.element_ty), mask=mask_s)


@triton.jit
def _step_kernel(
    q,
    k,
    v,
    g,
    beta,
    out,
    states,
    state_slots,
    Dk,
    Dv,
    value_per_key,
    q_scale,
    stride_q_b,
    stride_q_h,
    stride_q_d,
    stride_k_b,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_h,
    stride_v_d,
    stride_g_b,
    stride_g_h,
    stride_g_d,
    stride_beta_b,
    stride_beta_h,
    stride_o_b,
    stride_o_h,
    stride_o_d,
    stride_s_slot,
    stride_s_h,
    stride_s_k,
    stride_s_v,
    stride_slots_b,
    PER_CHANNEL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b64 = i_b.to(tl.int64)
    i_kh = i_h // value_per_key
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = o_k < Dk, o_v < Dv
    p_o = out + i_b64 * stride_o_b + i_h * stride_o_h + o_v * stride_o_d
    slot = tl.load(state_slots + i_b64 * stride_slots_b).to(tl.int64)
    if slot < 0:
        tl.store(p_o, tl.zeros([BLOCK_V], dtype=p_o.dtype.element_ty), mask=mask_v)
        return
    b_q = tl.load(q + i_b64 * stride_q_b + i_kh * stride_q_h + o_k * stride_q_d, mask=mask_k)
    b_k = tl.load(k + i_b64 * stride_k_b + i_kh * stride_k_h + o_k * stride_k_d, mask=mask_k)
    b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
    b_q = b_q * (q_scale / tl.sqrt(tl.sum(b_q * b_q, axis=0) + L2_EPS))
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + L2_EPS)
    b_v = tl.load(
        v + i_b64 * stride_v_b + i_h * stride_v_h + o_v * stride_v_d, mask=mask_v, other=0.0
    )
    b_decay = _decay(
        g + i_b64 * stride_g_b + i_h * stride_g_h, stride_g_d, o_k, mask_k, PER_CHANNEL
    )
    b_beta = tl.load(beta + i_b64 * stride_beta_b + i_h * stride_beta_h).to(tl.float32)

    mask_s = mask_k[:, None] & mask_v[None, :]
    p_s = (
        states
        + slot * stride_s_slot
        + i_h * stride_s_h
        + o_k[:, None] * stride_s_k
        + o_v[None, :] * stride_s_v
    )
    state = tl.load(p_s, mask=mask_s, other=0.0).to(tl.float32) * b_decay
    remembered = tl.sum(state * b_k[:, None], axis=0)  # S^T k: (BLOCK_V,)
    correction = (b_v.to(tl.float32) - remembered) * b_beta
    state += b_k[:, None] * correction[None, :]
    tl.store(p_s, state.to(p_s.dtype.element_ty), mask=mask_s)
    b_o = tl.sum(state * b_q[:, None], axis=0)
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)


@triton.jit
def _scan_kernel(
    q,
    k,
    v,
    g,
    beta,
    out,
    states,
    cu_seqlens,
    initial_slots,
    final_slots,
    Dk,
    Dv,
    value_per_key,
    q_scale,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_g_t,
    stride_g_h,
    stride_g_d,
    stride_beta_t,
    stride_beta_h,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_s_slot,
    stride_s_h,
    stride_s_k,
    stride_s_v,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Per-channel decay: the recurrence token by token, the (BLOCK_K, BLOCK_V) state block in
    registers for the whole sequence."""
    i_s, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // value_per_key
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = o_k < Dk, o_v < Dv
    mask_s = mask_k[:, None] & mask_v[None, :]
    o_s = i_h * stride_s_h + o_k[:, None] * stride_s_k + o_v[None, :] * stride_s_v
    first = tl.load(initial_slots + i_s).to(tl.int64)
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    if first >= 0:
        state = tl.load(states + first * stride_s_slot + o_s, mask=mask_s, other=0.0)
        state = state.to(tl.float32)
    start = tl.load(cu_seqlens + i_s).to(tl.int64)
    end = tl.load(cu_seqlens + i_s + 1).to(tl.int64)
    for t in range(start, end):
        b_q = tl.load(q + t * stride_q_t + i_kh * stride_q_h + o_k * stride_q_d, mask=mask_k)
        b_k = tl.load(k + t * stride_k_t + i_kh * stride_k_h + o_k * stride_k_d, mask=mask_k)
        b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
        b_q = b_q * (q_scale / tl.sqrt(tl.sum(b_q * b_q, axis=0) + L2_EPS))
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + L2_EPS)
        p_v = v + t * stride_v_t + i_h * stride_v_h + o_v * stride_v_d
        b_v = tl.load(p_v, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * stride_beta_t + i_h * stride_beta_h).to(tl.float32)
        p_g = g + t * stride_g_t + i_h * stride_g_h
        state = state * _decay(p_g, stride_g_d, o_k, mask_k, True)
        correction = (b_v - tl.sum(state * b_k[:, None], axis=0)) * b_beta
        state += b_k[:, None] * correction[None, :]
        p_o = out + t * stride_o_t + i_h * stride_o_h + o_v * stride_o_d
        b_o = tl.sum(state * b_q[:, None], axis=0)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)
    last = tl.load(final_slots + i_s).to(tl.int64)
    if last >= 0:
        p_last = states + last * stride_s_slot + o_s
        tl.store(p_last, state.to(p_last.dtype.element_ty), mask=mask_s)


def _blocks(Dk: int, Dv: int) -> tuple[int, int]:
    """BLOCK_K covers a whole key head (the L2 norm and S^T k need all of it); value columns
    come in blocks of at most 64, at least 16 (the smallest tl.dot)."""
    return max(16, triton.next_power_of_2(Dk)), max(16, min(64, triton.next_power_of_2(Dv)))


def gated_delta_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    states: torch.Tensor,
    initial_state_slots: torch.Tensor,
    final_state_slots: torch.Tensor,
    chunk_size: int = CHUNK,
) -> torch.Tensor:
    """`gated_delta_chunk_ref` in Triton (states: any strides, e.g. `pool[:, layer]`)."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    assert k.shape == q.shape and Hv % Hk == 0 and states.shape[1:] == (Hv, Dk, Dv)
    assert chunk_size == CHUNK, f"the Triton kernel runs chunks of {CHUNK}, not {chunk_size}"
    out = torch.empty_like(v)
    if T == 0:
        return out
    BLOCK_K, BLOCK_V = _blocks(Dk, Dv)
    grid = (num_seqs, Hv, triton.cdiv(Dv, BLOCK_V))
    args = (q, k, v, g, beta, out, states, cu_seqlens, initial_state_slots, final_state_slots)
    layout = {
        **strides("q", q, "t", "h", "d"),
        **strides("k", k, "t", "h", "d"),
        **strides("v", v, "t", "h", "d"),
        **strides("g", g, "t", "h"),
        **strides("beta", beta, "t", "h"),
        **strides("o", out, "t", "h", "d"),
        **strides("s", states, "slot", "h", "k", "v"),
    }
    shape = (Dk, Dv, Hv // Hk, Dk**-0.5)
    if g.dim() == 3:  # per-channel decay: the recurrence
        _scan_kernel[grid](
            *args, *shape, **layout, stride_g_d=g.stride(2), BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V
        )
        return out
    _chunk_kernel[grid](*args, *shape, **layout, CHUNK_SIZE=CHUNK, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V)
    return out


def gated_delta_step(
    states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """`gated_delta_step_ref` in Triton (states: any strides, e.g. `pool[:, layer]`). Rows
    must use distinct slots (two programs writing one slot would race)."""
    rows, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    assert states.shape[1:] == (Hv, Dk, Dv) and state_slots.shape == (rows,)
    out = torch.empty_like(v)
    if rows == 0:
        return out
    BLOCK_K, BLOCK_V = _blocks(Dk, Dv)
    grid = (rows, Hv, triton.cdiv(Dv, BLOCK_V))
    _step_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        out,
        states,
        state_slots,
        Dk,
        Dv,
        Hv // Hk,
        Dk**-0.5,
        **strides("q", q, "b", "h", "d"),
        **strides("k", k, "b", "h", "d"),
        **strides("v", v, "b", "h", "d"),
        **strides("g", g, "b", "h"),
        stride_g_d=g.stride(2) if g.dim() == 3 else 0,
        **strides("beta", beta, "b", "h"),
        **strides("o", out, "b", "h", "d"),
        **strides("s", states, "slot", "h", "k", "v"),
        **strides("slots", state_slots, "b"),
        PER_CHANNEL=g.dim() == 3,
        BLOCK_K=BLOCK_K,
        BLOCK_V=BLOCK_V,
    )
    return out
