"""Decoding e4m3 bytes in a Triton kernel (FP8 weights and an FP8 KV cache).

The bytes are decoded with integer operations rather than an fp8 load: e4m3's sign, exponent
and mantissa, shifted into float16's positions, are the same number times 2^-8 (normals and
subnormals alike, the bias differing by 8). That runs on GPUs without FP8 units and under the
interpreter, which has no float8 type; callers pass float8 tensors as their uint8 views.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_e4m3(b_w):
    """uint8 e4m3fn bytes -> float32 values (0x7f and 0xff, e4m3fn's NaNs, to NaN)."""
    b_w = b_w.to(tl.uint16)
    b_bits = ((b_w & 0x7F) << 7) | ((b_w & 0x80) << 8)
    b_x = b_bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((b_w & 0x7F) == 0x7F, float("nan"), b_x)
