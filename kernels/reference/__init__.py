"""Pure-torch reference kernels: the CPU path and the oracle for the Triton kernels."""

from __future__ import annotations

from .attention import paged_attention_decode_ref, paged_attention_prefill_ref, store_kv_ref
from .conv1d import Conv1dOutput, causal_conv1d_ref, causal_conv1d_update_ref
from .gated_delta import gated_delta_chunk_ref, gated_delta_step_ref
from .linear import dequantize_fp8, fp8_linear_ref, linear_ref
from .mamba1 import mamba1_scan_ref, mamba1_step_ref
from .norm import gated_rms_norm_ref, rms_norm_ref
from .ssd import ChunkScanOutput, mamba_chunk_scan_ref
from .state_update import selective_state_update_ref

__all__ = [
    "ChunkScanOutput",
    "Conv1dOutput",
    "causal_conv1d_ref",
    "causal_conv1d_update_ref",
    "dequantize_fp8",
    "fp8_linear_ref",
    "gated_delta_chunk_ref",
    "gated_delta_step_ref",
    "gated_rms_norm_ref",
    "linear_ref",
    "mamba1_scan_ref",
    "mamba1_step_ref",
    "mamba_chunk_scan_ref",
    "paged_attention_decode_ref",
    "paged_attention_prefill_ref",
    "rms_norm_ref",
    "selective_state_update_ref",
    "store_kv_ref",
]
