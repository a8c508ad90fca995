"""The FP8 GEMMs against float64 arithmetic on the exact values of the weight's bytes: the
reference (dequantise, then torch's GEMM), the CPU kernel (the C mat-vec reading bytes up to
GEMV_ROWS rows, dequantised pieces above) and the Triton kernel (decoding bytes in registers),
for groups that divide the columns, groups that do not (a short last group), and one group of
all columns (per-channel scales)."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.cpu import gemm
from hybridserve.kernels.reference import dequantize_fp8, fp8_linear_ref
from tests.kernels.triton.device import on_device

E4M3_MAX = 448.0


def e4m3_values() -> torch.Tensor:
    """Every byte's value, from the format's definition (sign, 4-bit exponent with bias 7,
    3-bit mantissa; exponent 0 is subnormal; 0x7f and 0xff are NaN)."""
    values = []
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if exponent == 0:
            value = mantissa / 8 * 2.0**-6
        else:
            value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        values.append(float("nan") if byte & 0x7F == 0x7F else sign * value)
    return torch.tensor(values, dtype=torch.float64)


def make_case(rows: int, out: int, inner: int, group: int, seed: int = 0):
    """x, a random FP8 weight (every finite byte value can occur, subnormals included), its
    group scales and the float64 product with the bytes' exact values."""
    gen = torch.Generator().manual_seed(seed)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    weight = finite[torch.randint(0, len(finite), (out, inner), generator=gen)]
    weight = weight.view(torch.float8_e4m3fn)
    groups = -(-inner // group)
    scale = torch.rand(out, groups, generator=gen) / E4M3_MAX + 1e-4
    x = torch.randn(rows, inner, generator=gen)
    exact = e4m3_values()[weight.view(torch.uint8).long()]
    exact = exact * scale.double().repeat_interleave(group, dim=1)[:, :inner]
    bias = torch.randn(out, generator=gen)
    return x, weight, scale, bias, exact


SHAPES = [
    # rows, out, inner, group
    (1, 37, 130, 48),  # a short last group; a tail after the registers' stride
    (3, 64, 256, 128),  # block-wise FP8's groups
    (8, 20, 96, 96),  # one group: per-channel scales
    (9, 33, 70, 32),  # above the mat-vec: dequantised pieces
    (40, 130, 64, 16),
]


def test_byte_decoding_matches_the_format():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    torch.testing.assert_close(every.double(), e4m3_values(), equal_nan=True)
    ones = torch.ones(256, 1)
    decoded = dequantize_fp8(every[:, None], ones, 1).double()[:, 0]
    torch.testing.assert_close(decoded, e4m3_values(), equal_nan=True)


@pytest.mark.parametrize(("rows", "out", "inner", "group"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kernel", ["reference", "cpu"])
def test_cpu_kernels_match_exact_arithmetic(rows, out, inner, group, with_bias, kernel):
    x, weight, scale, bias, exact = make_case(rows, out, inner, group)
    bias = bias if with_bias else None
    run = fp8_linear_ref if kernel == "reference" else gemm.fp8_linear
    with torch.inference_mode():
        y = run(x, weight, scale, group, bias)
    expected = x.double() @ exact.T + (0 if bias is None else bias.double())
    assert y.shape == (rows, out) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_few_rows_take_the_c_matvec(monkeypatch):
    assert gemm.gemv_fp8_kernel() is not None, "CI has a C compiler: the mat-vec must build"
    x, weight, scale, _, _ = make_case(2, 16, 64, 32)
    # With the dequantising path broken, only the mat-vec can still give the right answer.
    monkeypatch.setattr(gemm, "dequantize_fp8", lambda *a: None)
    with torch.inference_mode():
        y = gemm.fp8_linear(x, weight, scale, 32)
    torch.testing.assert_close(y, fp8_linear_ref(x, weight, scale, 32), rtol=1e-5, atol=1e-5)


@pytest.mark.triton
@pytest.mark.parametrize(("rows", "out", "inner", "group"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_kernel_matches_exact_arithmetic(rows, out, inner, group, with_bias):
    from hybridserve.kernels.triton.fp8_linear import fp8_linear

    x, weight, scale, bias, exact = make_case(rows, out, inner, group)
    bias = bias if with_bias else None
    y = on_device(fp8_linear)(x, weight, scale, group, bias)
    expected = x.double() @ exact.T + (0 if bias is None else bias.double())
    assert y.shape == (rows, out) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
