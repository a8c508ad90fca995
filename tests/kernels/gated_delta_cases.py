"""Inputs and the float64 sequential oracle shared by the gated delta rule tests (reference,
CPU and Triton kernels): odd shapes (head dims that are not powers of two, more value than key
heads, lengths that are not a multiple of the chunk), states in a strided slot pool."""

from __future__ import annotations

import torch

HK, HV, DK, DV = 2, 6, 12, 10
NUM_SLOTS, NUM_LAYERS, LAYER = 8, 2, 1
# Packed sequences: shorter than a chunk, exactly one, one and a bit, several.
LENGTHS = [5, 64, 70, 150]
# Sequence i starts from slot INITIAL[i] (-1: zero) and ends in FINAL[i] (-1: not written);
# sequence 1 reads and writes one slot.
INITIAL = [-1, 3, 2, -1]
FINAL = [6, 3, -1, 0]


def make_inputs(
    lengths: list[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    aligned: bool = False,
    per_channel: bool = False,
) -> dict:
    """With `aligned`, keys barely vary, beta is near 1 and there is almost no decay: the
    in-chunk system (I + A) is far from the identity, so every power of A in its inverse
    counts (a kernel that truncates it is caught). With `per_channel`, g decays each key
    channel on its own (Kimi Delta Attention): (T, Hv, Dk)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    # q | k | v come out of one conv output: column slices of it, strided as in the model.
    mixed = randn(T, 2 * HK * DK + HV * DV + 3)
    if aligned:
        mixed[:, HK * DK : 2 * HK * DK] = randn(1, HK * DK) + 0.05 * randn(T, HK * DK)
    q = mixed[:, : HK * DK].unflatten(1, (HK, DK))
    k = mixed[:, HK * DK : 2 * HK * DK].unflatten(1, (HK, DK))
    v = mixed[:, 2 * HK * DK : 2 * HK * DK + HV * DV].unflatten(1, (HV, DV))
    decay = 0.02 if aligned else 1.2
    return {
        "q": q.to(dtype),
        "k": k.to(dtype),
        "v": v.to(dtype),
        # Decays from ~0.3 to ~1 per token: long products stay representable.
        "g": -torch.rand(T, HV, *((DK,) if per_channel else ()), generator=gen) * decay,
        "beta": 0.9 + 0.1 * torch.rand(T, HV, generator=gen)
        if aligned
        else torch.rand(T, HV, generator=gen),
        # Every layer's states; a layer's are the strided view pool[:, LAYER].
        "pool": randn(NUM_SLOTS, NUM_LAYERS, HV, DK, DV) * 0.3,
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
    }


def oracle(q, k, v, g, beta, state):
    """One sequence, one token at a time, in float64: (outputs (L, Hv, Dv), final state)."""
    rep = HV // HK
    q, k = q.double(), k.double()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * DK**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    v, g, beta, state = v.double(), g.double(), beta.double(), state.double().clone()
    outputs = []
    for t in range(q.shape[0]):
        decay = torch.exp(g[t])
        state = state * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
        remembered = (state * k[t][:, :, None]).sum(1)
        state = state + k[t][:, :, None] * ((v[t] - remembered) * beta[t][:, None])[:, None, :]
        outputs.append((state * q[t][:, :, None]).sum(1))
    return torch.stack(outputs), state
