"""Kernels used by the model layers, under backend-neutral names.

Each name runs the Triton kernel or the torch reference (`kernels.reference`, the CPU path and
the oracle) with the same signature; `kernels.dispatch` picks per call. `rms_norm` is
reference-only (torch's fused rms_norm is used on every device), so are the `*_pooled`
decode kernels that the compiled decode step traces; `cpu_gemm` is the CPU small-batch GEMM,
and `cpu_ops` the torch operators (C++) through which layers call the CPU kernels.
"""

from __future__ import annotations

from .dispatch import dispatched
from .reference import ChunkScanOutput, Conv1dOutput
from .reference import rms_norm_ref as rms_norm
from .reference.pooled import (
    attention_decode_pooled,
    conv_update_pooled,
    state_update_pooled,
    store_kv_pooled,
)

causal_conv1d = dispatched("causal_conv1d")
causal_conv1d_update = dispatched("causal_conv1d_update")
gated_rms_norm = dispatched("gated_rms_norm")
mamba_chunk_scan = dispatched("mamba_chunk_scan")
paged_attention_decode = dispatched("paged_attention_decode")
paged_attention_prefill = dispatched("paged_attention_prefill")
selective_state_update = dispatched("selective_state_update")
store_kv = dispatched("store_kv")

__all__ = [
    "ChunkScanOutput",
    "Conv1dOutput",
    "attention_decode_pooled",
    "causal_conv1d",
    "causal_conv1d_update",
    "conv_update_pooled",
    "gated_rms_norm",
    "mamba_chunk_scan",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "selective_state_update",
    "state_update_pooled",
    "store_kv",
    "store_kv_pooled",
]
