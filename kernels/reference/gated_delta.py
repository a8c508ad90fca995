"""The gated delta rule (Gated DeltaNet) over packed sequences and decode rows, in pure torch.

Per sequence and value head h (its key head: h // (Hv / Hk)), with q and k L2-normalised and q
scaled by Dk^-1/2, starting from the state S_0 (Dk, Dv) read from a slot pool:

    S_t = exp(g_t) * S_{t-1}                                    decay
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T              delta rule: correct k_t's value
    o_t = S_t^T q_t

The prompt form (`gated_delta_chunk_ref`) cuts each sequence into chunks of `chunk_size` tokens
from its first token. Inside a chunk the corrections of all tokens come from one triangular
solve (the WY / UT form): with G_i the cumulative log decay to lane i,

    A = strictly_lower((beta k) k^T * exp(G_i - G_j)),   T = (I + A)^-1
    u = T (beta v),                                      w = T (beta k exp(G))
    v'  = u - w S                                        (corrections given the chunk's start S)
    o   = (q exp(G)) S + (q k^T * exp(G_i - G_j), lower incl. diagonal) v'
    S'  = exp(G_last) S + (k exp(G_last - G))^T v'

and only one state per chunk is carried from chunk to chunk. Everything is float32.

The decay is per value head (Gated DeltaNet: g is (T, Hv)) or per key channel of each head
(Kimi Delta Attention: g is (T, Hv, Dk), row i of S decays by exp(g_t[i])). With per-channel
decay the chunk's decay matrix differs per channel, so the prompt form here is the recurrence,
token by token, all sequences side by side.
"""

from __future__ import annotations

import torch

from ._common import ChunkLayout, read_slots, write_slots

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, float32 (the FLA convention)."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + L2_EPS)


def _heads(q: torch.Tensor, k: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, ...]:
    """q and k L2-normalised (q also scaled), repeated from key heads to value heads."""
    repeat = value_heads // q.shape[-2]
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    k = l2_normalize(k)
    return q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)


def gated_delta_chunk_ref(
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
    chunk_size: int = 64,
) -> torch.Tensor:
    """Run the gated delta rule over S packed sequences, reading and writing a slot pool.

    Shapes (T tokens, Hk key heads, Hv value heads, a multiple of Hk; Dk, Dv head dims):
        q, k: (T, Hk, Dk), before L2 normalisation; v: (T, Hv, Dv)
        g: (T, Hv) or (T, Hv, Dk), log decay (<= 0); beta: (T, Hv)
        cu_seqlens: (S + 1,) cumulative token offsets; every sequence has at least one token
        states: (num_slots, Hv, Dk, Dv), written in place at `final_state_slots`
        initial_state_slots: (S,); -1 starts the sequence from a zero state
        final_state_slots: (S,); -1 skips writing the sequence's final state
    Returns the output (T, Hv, Dv) in v.dtype. Every initial state is read before any final
    state is written, so a slot may be both read and written in one call.
    """
    T, Hv, Dv = v.shape
    Dk = k.shape[-1]
    num_seqs = cu_seqlens.shape[0] - 1
    assert q.shape == k.shape and q.shape[0] == T and Hv % q.shape[1] == 0
    assert g.shape in ((T, Hv), (T, Hv, Dk)) and beta.shape == (T, Hv)
    assert states.shape[1:] == (Hv, Dk, Dv)
    assert initial_state_slots.shape == (num_seqs,) and final_state_slots.shape == (num_seqs,)
    qf, kf = _heads(q, k, Hv)
    device = v.device
    if g.dim() == 3:
        return _recurrence(
            qf, kf, v, g, beta, cu_seqlens, states, initial_state_slots, final_state_slots
        )

    # All chunks of all sequences at once (ChunkLayout). A padded lane has g = 0 and beta = 0:
    # no decay, no correction, nothing changes.
    layout = ChunkLayout.of(cu_seqlens, chunk_size)
    qc, kc, vc = (layout.to_chunks(t) for t in (qf, kf, v.float()))
    gc = layout.to_chunks(g.float()[..., None])[..., 0]  # (K, Hv, Q)
    bc = layout.to_chunks(beta.float()[..., None])[..., 0]
    G = gc.cumsum(dim=-1)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()
    # exp(G_i - G_j) for j <= i (the decay from lane j to lane i), 0 above the diagonal.
    decay = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")))
    k_beta = kc * bc[..., None]
    A = (k_beta @ kc.transpose(-1, -2) * decay).tril(-1)
    identity = torch.eye(chunk_size, device=device)
    # T = (I + A)^-1, A strictly lower: a unit lower-triangular solve.
    u = torch.linalg.solve_triangular(identity + A, vc * bc[..., None], upper=False)
    w = torch.linalg.solve_triangular(identity + A, k_beta * torch.exp(G)[..., None], upper=False)
    attention = qc @ kc.transpose(-1, -2) * decay  # (K, Hv, Q, Q), lower incl. diagonal
    q_decayed = qc * torch.exp(G)[..., None]
    k_to_end = kc * torch.exp(G[..., -1:] - G)[..., None]
    chunk_decay = torch.exp(G[..., -1])[..., None, None]  # (K, Hv, 1, 1)

    current = read_slots(states, initial_state_slots)  # (S, Hv, Dk, Dv) float32
    out = torch.empty_like(vc)
    counts = layout.chunks_per_seq.tolist()
    firsts = layout.first_chunk.tolist()
    for ordinal in range(max(counts, default=0)):
        seqs = [s for s, count in enumerate(counts) if count > ordinal]
        chunks = torch.tensor([firsts[s] + ordinal for s in seqs], device=device)
        seq_idx = torch.tensor(seqs, device=device)
        start = current[seq_idx]  # (b, Hv, Dk, Dv)
        corrected = u[chunks] - w[chunks] @ start
        out[chunks] = q_decayed[chunks] @ start + attention[chunks] @ corrected
        current[seq_idx] = chunk_decay[chunks] * start + k_to_end[chunks].transpose(-1, -2) @ (
            corrected
        )
    write_slots(states, final_state_slots, current)
    return layout.to_tokens(out).to(v.dtype)


def _advance(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of states (B, Hv, Dk, Dv): (new states, outputs (B, Hv, Dv)).
    q, k: (B, Hv, Dk) normalised; v: (B, Hv, Dv); g: (B, Hv) or (B, Hv, Dk); beta: (B, Hv)."""
    decay = torch.exp(g.float())
    state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
    remembered = (state * k[..., None]).sum(dim=-2)  # S^T k: (B, Hv, Dv)
    correction = (v.float() - remembered) * beta.float()[..., None]
    state = state + k[..., None] * correction[..., None, :]
    return state, (state * q[..., None]).sum(dim=-2)


def _recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    states: torch.Tensor,
    initial_state_slots: torch.Tensor,
    final_state_slots: torch.Tensor,
) -> torch.Tensor:
    """The prompt form for per-channel decay: token by token, every sequence at once (one
    shorter than the longest is padded with g = 0 and beta = 0, which change nothing)."""
    lengths = cu_seqlens.diff().long()
    num_seqs = lengths.shape[0]
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=v.device), lengths)
    lanes = torch.arange(v.shape[0], device=v.device) - cu_seqlens[seq_ids].long()
    longest = int(lengths.max())

    def padded(t: torch.Tensor) -> torch.Tensor:  # (T, ...) -> (S, longest, ...)
        out = t.new_zeros((num_seqs, longest, *t.shape[1:]))
        out[seq_ids, lanes] = t
        return out

    qp, kp, vp, gp, bp = (padded(t.float()) for t in (q, k, v, g, beta))
    state = read_slots(states, initial_state_slots)
    outputs = []
    for t in range(longest):
        state, out = _advance(state, qp[:, t], kp[:, t], vp[:, t], gp[:, t], bp[:, t])
        outputs.append(out)
    write_slots(states, final_state_slots, state)
    return torch.stack(outputs, dim=1)[seq_ids, lanes].to(v.dtype)


def gated_delta_step_ref(
    states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """Advance each row's state by one token and return that token's output.

    Shapes (Bt rows): states (num_slots, Hv, Dk, Dv), updated in place; q, k: (Bt, Hk, Dk)
    before L2 normalisation; v: (Bt, Hv, Dv); g: (Bt, Hv) or (Bt, Hv, Dk); beta: (Bt, Hv);
    state_slots: (Bt,), -1 marks a padding row (the pool is untouched, the output zero). Rows
    must use distinct slots. Returns (Bt, Hv, Dv) in v.dtype.
    """
    Bt, Hv, Dv = v.shape
    assert states.shape[1] == Hv and states.shape[3] == Dv and state_slots.shape == (Bt,)
    qf, kf = _heads(q, k, Hv)
    valid = state_slots >= 0
    state, out = _advance(read_slots(states, state_slots), qf, kf, v, g, beta)
    write_slots(states, state_slots, state)
    return torch.where(valid[:, None, None], out, 0.0).to(v.dtype)
