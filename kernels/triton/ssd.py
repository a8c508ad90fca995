"""Mamba2 chunked scan (SSD) over packed variable-length sequences, as one fused Triton kernel.

Same contract as `kernels.reference.ssd.mamba_chunk_scan_ref`. Per sequence and head h:

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t)      S: (P, N)
    y_t = S_t @ C_t + D * x_t

One program owns one (sequence, head, block of BP head dims) and walks the sequence's chunks of
BT tokens in order, keeping its part of the running state, S^T (N, BP), in float32 registers.
The chunks of one sequence are sequential; sequences, heads and head-dim blocks are parallel.
Chunks start at each sequence's own first token; the last chunk is padded with dt = 0 and
x = B = C = 0 lanes, which neither decay nor feed the state:

    packed tokens:    | s0 s0 s0 s0 s0 | s1 s1 |
    programs (BT=4):  (s0, h, p): | s0 s0 s0 s0 | s0 __ __ __ |      (s1, h, p): | s1 s1 __ __ |

Inside a chunk, with cs = cumsum(dt * A) (the log decay from the chunk start to each lane):

    y_l   = sum_{s <= l} (C_l . B_s) exp(cs_l - cs_s) dt_s x_s   (intra-chunk, quadratic)
          + exp(cs_l) * (C_l @ S_start^T)                        (carried state)
          + D * x_l
    S_end = exp(cs_last) * S_start + sum_s exp(cs_last - cs_s) dt_s outer(x_s, B_s)

and the state after lane l (a requested position) is the same update cut after lane l.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference._common import positions_by_seq
from ..reference.ssd import ChunkScanOutput
from .launch import strides

__all__ = ["ChunkScanOutput", "mamba_chunk_scan"]


@triton.heuristics(
    {
        "HAS_D": lambda args: args["D"] is not None,
        "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
        "HAS_POSITIONS": lambda args: args["pos_offsets"] is not None,
    }
)
@triton.jit
def _mamba_chunk_scan_kernel(
    # pointers
    x,
    dt,
    A,
    B,
    C,
    D,
    dt_bias,
    out,
    cu_seqlens,
    init_states,
    init_slots,
    final_states,
    final_slots,
    pos_offsets,
    pos_values,
    pos_rows,
    pos_states,
    # dims
    P,
    N,
    heads_per_group,
    dt_min,
    dt_max,
    # strides
    stride_x_t,
    stride_x_h,
    stride_x_p,
    stride_dt_t,
    stride_dt_h,
    stride_b_t,
    stride_b_g,
    stride_b_n,
    stride_c_t,
    stride_c_g,
    stride_c_n,
    stride_o_t,
    stride_o_h,
    stride_o_p,
    stride_is_slot,
    stride_is_h,
    stride_is_p,
    stride_is_n,
    stride_fs_slot,
    stride_fs_h,
    stride_fs_p,
    stride_fs_n,
    stride_ps_k,
    stride_ps_h,
    stride_ps_p,
    stride_ps_n,
    # meta
    BT: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
):
    i_p, i_h, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_g = i_h // heads_per_group
    bos = tl.load(cu_seqlens + i_s)
    seq_len = (tl.load(cu_seqlens + i_s + 1) - bos).to(tl.int32)
    # Per-sequence base pointers in 64 bits; in-chunk block offsets below stay 32-bit.
    x += bos.to(tl.int64) * stride_x_t + i_h * stride_x_h
    dt += bos.to(tl.int64) * stride_dt_t + i_h * stride_dt_h
    B += bos.to(tl.int64) * stride_b_t + i_g * stride_b_g
    C += bos.to(tl.int64) * stride_c_t + i_g * stride_c_g
    out += bos.to(tl.int64) * stride_o_t + i_h * stride_o_h

    o_t = tl.arange(0, BT)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    mask_p = o_p < P
    mask_n = o_n < N
    mask_np = mask_n[:, None] & mask_p[None, :]
    # (l, s) pairs with s <= l: the causal part of a chunk's quadratic form.
    mask_causal = o_t[:, None] >= o_t[None, :]

    b_A = tl.load(A + i_h).to(tl.float32)
    if HAS_D:
        b_D = tl.load(D + i_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt_bias = tl.load(dt_bias + i_h).to(tl.float32)

    # The running state, transposed: b_ST = S^T (BN, BP) in float32, so that every tl.dot below
    # has a plain (M, K) @ (K, N) shape with M >= 64 where the shapes allow (Hopper wgmma).
    # Slot -1 starts from zeros. Reading it before any store of this program makes "read slot,
    # write the same slot" safe; see `_fwd` for slots shared between sequences.
    i_init = tl.load(init_slots + i_s).to(tl.int64)
    p_init = (
        init_states
        + i_init * stride_is_slot
        + i_h * stride_is_h
        + o_n[:, None] * stride_is_n
        + o_p[None, :] * stride_is_p
    )
    b_ST = tl.zeros((BN, BP), dtype=tl.float32)
    if i_init >= 0:
        b_ST = tl.load(p_init, mask=mask_np, other=0.0).to(tl.float32)

    if HAS_POSITIONS:
        # Requested positions of this sequence, sorted: i_k walks them as the chunks go by.
        i_k = tl.load(pos_offsets + i_s)
        k_end = tl.load(pos_offsets + i_s + 1)

    for i_c in range(0, tl.cdiv(seq_len, BT)):
        o_tok = i_c * BT + o_t  # positions in the sequence
        mask_t = o_tok < seq_len
        mask_tp = mask_t[:, None] & mask_p[None, :]
        mask_tn = mask_t[:, None] & mask_n[None, :]
        mask_nt = mask_n[:, None] & mask_t[None, :]

        # x (BT, BP), dt (BT,), B^T (BN, BT), C (BT, BN); padding lanes are zero.
        p_x = x + o_tok[:, None] * stride_x_t + o_p[None, :] * stride_x_p
        b_x = tl.load(p_x, mask=mask_tp, other=0.0).to(tl.float32)
        b_dt = tl.load(dt + o_tok * stride_dt_t, mask=mask_t, other=0.0).to(tl.float32)
        p_Bt = B + o_n[:, None] * stride_b_n + o_tok[None, :] * stride_b_t
        b_Bt = tl.load(p_Bt, mask=mask_nt, other=0.0)
        p_C = C + o_tok[:, None] * stride_c_t + o_n[None, :] * stride_c_n
        b_C = tl.load(p_C, mask=mask_tn, other=0.0)

        # dt' = clamp(softplus(dt + dt_bias)); torch's softplus returns x itself above 20.
        if HAS_DT_BIAS:
            b_dt += b_dt_bias
        if DT_SOFTPLUS:
            b_sp = tl.log(1.0 + tl.exp(tl.minimum(b_dt, 20.0)))  # no inf in the unused branch
            b_dt = tl.where(b_dt <= 20.0, b_sp, b_dt)
        b_dt = tl.minimum(tl.maximum(b_dt, dt_min), dt_max)
        # NOTE: after the clamp, which may lift padding lanes above zero.
        b_dt = tl.where(mask_t, b_dt, 0.0)

        b_cs = tl.cumsum(b_dt * b_A, axis=0)  # (BT,) log decay from the chunk start
        # Padding lanes add nothing to the cumsum, so the last lane is the chunk's total decay.
        b_cs_last = tl.sum(tl.where(o_t == BT - 1, b_cs, 0.0), axis=0)

        # Intra-chunk: scores[l, s] = (C_l . B_s) exp(cs_l - cs_s) dt_s for s <= l. The masked
        # exponent is -inf (not cs_l - cs_s > 0, which may overflow) above the diagonal.
        b_decay = tl.exp(tl.where(mask_causal, b_cs[:, None] - b_cs[None, :], float("-inf")))
        # NOTE: C @ B^T in the input dtype: products of 16-bit inputs are exact in float32.
        b_scores = tl.dot(b_C, b_Bt, input_precision=DOT_PRECISION)  # (BT, BT)
        b_C = b_C.to(tl.float32)
        b_Bt = b_Bt.to(tl.float32)
        b_scores = b_scores * b_decay * b_dt[None, :]
        b_y = tl.dot(b_scores, b_x, input_precision=DOT_PRECISION)  # (BT, BP)
        # Carried state: exp(cs_l) * (C_l @ S_start^T).
        b_y += tl.dot(b_C, b_ST, input_precision=DOT_PRECISION) * tl.exp(b_cs)[:, None]
        if HAS_D:
            b_y += b_D * b_x
        p_out = out + o_tok[:, None] * stride_o_t + o_p[None, :] * stride_o_p
        tl.store(p_out, b_y.to(out.dtype.element_ty), mask=mask_tp)

        if HAS_POSITIONS:
            # States after `pos` tokens for the requested pos in (chunk start, chunk end]:
            # lane l = pos - 1 - chunk start, S_l = exp(cs_l) S_start + sum_{s <= l} ...
            chunk_end = tl.minimum(i_c * BT + BT, seq_len)
            pos = tl.load(pos_values + i_k, mask=i_k < k_end, other=0)
            while (i_k < k_end) & (pos <= chunk_end):
                i_l = pos - 1 - i_c * BT
                b_cs_l = tl.sum(tl.where(o_t == i_l, b_cs, 0.0), axis=0)
                b_w = tl.where(o_t <= i_l, tl.exp(b_cs_l - b_cs), 0.0) * b_dt  # (BT,)
                b_ST_l = tl.exp(b_cs_l) * b_ST + tl.dot(
                    b_Bt * b_w[None, :], b_x, input_precision=DOT_PRECISION
                )  # (BN, BP)
                i_row = tl.load(pos_rows + i_k).to(tl.int64)
                p_ps = (
                    pos_states
                    + i_row * stride_ps_k
                    + i_h * stride_ps_h
                    + o_n[:, None] * stride_ps_n
                    + o_p[None, :] * stride_ps_p
                )
                tl.store(p_ps, b_ST_l.to(pos_states.dtype.element_ty), mask=mask_np)
                i_k += 1
                pos = tl.load(pos_values + i_k, mask=i_k < k_end, other=0)

        # S_end = exp(cs_last) S_start + sum_s exp(cs_last - cs_s) dt_s outer(x_s, B_s).
        b_w = tl.exp(b_cs_last - b_cs) * b_dt  # (BT,)
        b_ST = b_ST * tl.exp(b_cs_last) + tl.dot(
            b_Bt * b_w[None, :], b_x, input_precision=DOT_PRECISION
        )

    i_final = tl.load(final_slots + i_s).to(tl.int64)
    p_final = (
        final_states
        + i_final * stride_fs_slot
        + i_h * stride_fs_h
        + o_n[:, None] * stride_fs_n
        + o_p[None, :] * stride_fs_p
    )
    if i_final >= 0:
        tl.store(p_final, b_ST.to(final_states.dtype.element_ty), mask=mask_np)


def _positions_csr(
    state_positions: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate `state_positions` (K, 2) and regroup it per sequence, sorted by position.

    Returns int32 tensors on the positions' device: offsets (S + 1,) into values (K,) = the
    positions and rows (K,) = the output row of each. Raises ValueError like the reference.
    """
    by_seq = positions_by_seq(state_positions, cu_seqlens.tolist())
    pairs = [sorted(seq, key=lambda row_pos: row_pos[1]) for seq in by_seq]
    offsets = [0]
    for seq in pairs:
        offsets.append(offsets[-1] + len(seq))
    values = [pos for seq in pairs for _, pos in seq]
    rows = [row for seq in pairs for row, _ in seq]
    device = cu_seqlens.device

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return as_tensor(offsets), as_tensor(values), as_tensor(rows)


def _mamba_chunk_scan_fwd(
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
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    state_positions: torch.Tensor | None,
) -> ChunkScanOutput:
    T, H, P = x.shape
    G, N = B.shape[-2:]
    num_seqs = cu_seqlens.shape[0] - 1
    assert dt.shape == (T, H) and A.shape == (H,)
    assert B.shape == (T, G, N) and C.shape == B.shape and C.dtype == B.dtype
    assert H % G == 0, f"nheads {H} is not a multiple of n_groups {G}"
    assert ssm_states.dim() == 4 and ssm_states.shape[1:] == (H, P, N)
    assert initial_state_slots.shape == (num_seqs,) and final_state_slots.shape == (num_seqs,)
    assert D is None or D.shape == (H,)
    assert dt_bias is None or dt_bias.shape == (H,)
    assert chunk_size >= 1
    cu_seqlens = cu_seqlens.contiguous()
    initial_state_slots = initial_state_slots.contiguous()
    final_state_slots = final_state_slots.contiguous()
    A = A.contiguous()
    D = D.contiguous() if D is not None else None
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None

    out = x.new_empty((T, H, P))
    pos_offsets = pos_values = pos_rows = position_states = None
    if state_positions is not None:
        pos_offsets, pos_values, pos_rows = _positions_csr(state_positions, cu_seqlens)
        position_states = ssm_states.new_empty((state_positions.shape[0], H, P, N))
    if num_seqs == 0:
        return ChunkScanOutput(out=out, position_states=position_states)

    # Each program reads its own initial slot before it writes its own final slot, and programs
    # touch disjoint (head, head-dim) blocks, so a sequence may read and write the same slot.
    # Programs of different sequences are not ordered, though: when one sequence's final slot
    # is another's initial slot, the initial states are snapshotted first (one host sync).
    init_states, init_slots = ssm_states, initial_state_slots
    if _initial_slots_overwritten(initial_state_slots, final_state_slots):
        valid = initial_state_slots >= 0
        init_states = ssm_states.index_select(0, initial_state_slots.clamp(min=0).long())
        init_slots = torch.where(valid, torch.arange(num_seqs, device=valid.device), -1)
        init_slots = init_slots.to(torch.int32)
    # NOTE: chunking is a tiling choice: any BT gives the same result up to rounding. All block
    # sizes are >= 16 for tl.dot. Sizes and warps keep the per-program registers (state (BN, BP),
    # C and B^T (BT, BN) as dot operands) free of spills at N = 128 (ptxas, sm_90); bigger BT
    # and BP spill there. Tune on the GPU.
    BT = min(max(triton.next_power_of_2(chunk_size), 16), 32)
    BN = max(triton.next_power_of_2(N), 16)
    BP = min(max(triton.next_power_of_2(P), 16), 32 if BN <= 128 else 16)
    num_warps = 4 if BN <= 32 else 8
    # fp32 inputs get exact fp32 products. With 16-bit inputs, C @ B^T runs in the input dtype
    # (exact products, fp32 sums) and the dots on float32 scores and states in tf32, whose
    # rounding (2^-11) stays at the inputs' own precision.
    dot_precision = "ieee" if torch.float32 in (x.dtype, B.dtype) else "tf32"
    grid = (triton.cdiv(P, BP), H, num_seqs)
    _mamba_chunk_scan_kernel[grid](
        x=x,
        dt=dt,
        A=A,
        B=B,
        C=C,
        D=D,
        dt_bias=dt_bias,
        out=out,
        cu_seqlens=cu_seqlens,
        init_states=init_states,
        init_slots=init_slots,
        final_states=ssm_states,
        final_slots=final_state_slots,
        pos_offsets=pos_offsets,
        pos_values=pos_values,
        pos_rows=pos_rows,
        pos_states=position_states,
        P=P,
        N=N,
        heads_per_group=H // G,
        dt_min=float(dt_limit[0]),
        dt_max=float(dt_limit[1]),
        **strides("x", x, "t", "h", "p"),
        **strides("dt", dt, "t", "h"),
        **strides("b", B, "t", "g", "n"),
        **strides("c", C, "t", "g", "n"),
        **strides("o", out, "t", "h", "p"),
        **strides("is", init_states, "slot", "h", "p", "n"),
        **strides("fs", ssm_states, "slot", "h", "p", "n"),
        **strides("ps", position_states, "k", "h", "p", "n"),
        BT=BT,
        BP=BP,
        BN=BN,
        DT_SOFTPLUS=dt_softplus,
        DOT_PRECISION=dot_precision,
        num_warps=num_warps,
    )
    return ChunkScanOutput(out=out, position_states=position_states)


def _initial_slots_overwritten(initial: torch.Tensor, final: torch.Tensor) -> bool:
    """Whether some sequence's initial slot is another sequence's final slot (host sync)."""
    clash = (initial[:, None] == final[None, :]) & (initial[:, None] >= 0)
    clash.fill_diagonal_(False)
    return bool(clash.any())


def mamba_chunk_scan(
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
        ssm_states: (num_slots, H, P, N), any strides (a per-layer view of a bigger pool),
            written in place at `final_state_slots`
        initial_state_slots: (S,); -1 starts the sequence from a zero state
        final_state_slots: (S,); -1 skips writing the sequence's final state; the slots >= 0
            must be distinct
        D: (H,); dt_bias: (H,)
        state_positions: (K, 2) rows (seq_index, pos) with 1 <= pos <= len(seq)

    Returns `out` (T, H, P) in x.dtype and, when `state_positions` is given, `position_states`
    (K, H, P, N) in ssm_states.dtype: row k is the state after the first `pos` tokens of sequence
    `seq_index`. Every initial state is read before any final state is written, so a slot may be
    both read and written in one call. `chunk_size` only sets the tiling (rounded to a power of
    two in [16, 32]); results do not depend on it beyond rounding. Costs one host sync (slot
    aliasing check), plus one to validate `state_positions` when given.
    """
    return _mamba_chunk_scan_fwd(
        x,
        dt,
        A,
        B,
        C,
        chunk_size=chunk_size,
        cu_seqlens=cu_seqlens,
        ssm_states=ssm_states,
        initial_state_slots=initial_state_slots,
        final_state_slots=final_state_slots,
        D=D,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        state_positions=state_positions,
    )
