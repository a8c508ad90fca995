"""Kernels used by the model layers, under backend-neutral names.

For now every name is the pure-torch reference from `kernels.reference`. The Triton backend and
the device dispatch come later and share these signatures, so callers import from here.
"""

from __future__ import annotations

from .reference import ChunkScanOutput, Conv1dOutput
from .reference import causal_conv1d_ref as causal_conv1d
from .reference import causal_conv1d_update_ref as causal_conv1d_update
from .reference import gated_rms_norm_ref as gated_rms_norm
from .reference import mamba_chunk_scan_ref as mamba_chunk_scan
from .reference import paged_attention_decode_ref as paged_attention_decode
from .reference import paged_attention_prefill_ref as paged_attention_prefill
from .reference import rms_norm_ref as rms_norm
from .reference import selective_state_update_ref as selective_state_update
from .reference import store_kv_ref as store_kv

__all__ = [
    "ChunkScanOutput",
    "Conv1dOutput",
    "causal_conv1d",
    "causal_conv1d_update",
    "gated_rms_norm",
    "mamba_chunk_scan",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "selective_state_update",
    "store_kv",
]
