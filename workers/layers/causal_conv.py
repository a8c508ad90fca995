"""The causal depthwise convolution in front of every recurrent layer's state update (Mamba2,
Mamba1, Gated DeltaNet, LFM2's short convolution), over a batch's rows.

Its window is the layer's `conv` state tensor (models/recurrent_state.py): decode rows (the
batch's first `num_decode`) each shift one input into their slot's window; prefill sequences
run the varlen conv from zero (a first chunk) or from their live slot, and leave their window
in their slot.
"""

from __future__ import annotations

import torch

from hybridserve.kernels import causal_conv1d, conv_update_pooled
from hybridserve.workers.runner.forward_batch import ForwardBatch, RecurrentLayer


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch: ForwardBatch,
    state: RecurrentLayer,
    activation: str | None,
) -> torch.Tensor:
    """x: (T, C) -> (T, C); weight: (C, W)."""
    nd = batch.num_decode
    parts = []
    if nd:
        # Through (pool, layer): a step the compiled path traces writes the pool in place.
        parts.append(
            conv_update_pooled(
                x[:nd],
                weight,
                bias,
                conv_pool=state.pools["conv"],
                layer=state.layer,
                state_slots=batch.state_slots[:nd],
                activation=activation,
            )
        )
    if x.shape[0] > nd:
        parts.append(
            causal_conv1d(
                x[nd:],
                weight,
                bias,
                cu_seqlens=batch.prefill_cu_seqlens,
                conv_states=state.views["conv"],
                initial_state_slots=batch.prefill_initial_slots,
                final_state_slots=batch.state_slots[nd:],
                activation=activation,
            ).out
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)
