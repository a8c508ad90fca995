"""oneDNN-packed small-batch linear equals the plain linear, called from Python and as the
compiled step's operator."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import operators, register_packed
from hybridserve.kernels.cpu import gemm, ops
from hybridserve.kernels.cpu.gemm import GEMV_ROWS, SMALL_BATCH, can_pack, linear, pack_weight

pytestmark = pytest.mark.skipif(
    not can_pack(torch.zeros(1, 1)), reason="this torch build has no oneDNN linear"
)


@pytest.mark.parametrize("rows", [1, 7, SMALL_BATCH, SMALL_BATCH + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_plain(rows, with_bias):
    torch.manual_seed(rows)
    x = torch.randn(rows, 96)
    weight = torch.randn(130, 96) / 10
    bias = torch.randn(130) if with_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    out = linear(x, weight, bias, pack_weight(weight))
    assert out.shape == (rows, 130) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_weights_are_packed():
    assert can_pack(torch.zeros(4, 4))
    assert not can_pack(torch.zeros(4, 4, dtype=torch.float16))
    assert not can_pack(torch.zeros(4))


@pytest.mark.parametrize("rows", [1, 2, 5, GEMV_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_up_to_gemv_rows_take_the_c_matvec_and_match_torch(rows, with_bias, monkeypatch):
    assert gemm.gemv_kernel() is not None, "CI has a C compiler: the mat-vec must build"
    calls = []
    gemv = gemm._gemv
    monkeypatch.setattr(gemm, "_gemv", lambda *a: calls.append(1) or gemv(*a))
    gen = torch.Generator().manual_seed(rows)
    # 302 weight rows: the last piece of four is two rows; 130 columns: a tail after the
    # registers' stride.
    weight = torch.randn(302, 130, generator=gen)
    bias = torch.randn(302, generator=gen) if with_bias else None
    # A strided x (a column slice), as activations often are.
    x = torch.randn(rows, 140, generator=gen)[:, 5:135]
    with torch.inference_mode():
        y = gemm.linear(x, weight, bias)
    assert calls == [1]
    torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_more_rows_and_other_dtypes_stay_on_torch(monkeypatch):
    monkeypatch.setattr(gemm, "_gemv", lambda *a: pytest.fail("the mat-vec ran"))
    weight = torch.randn(8, 4)
    with torch.inference_mode():
        gemm.linear(torch.randn(GEMV_ROWS + 1, 4), weight)
        gemm.linear(torch.randn(1, 4, dtype=torch.bfloat16), weight.bfloat16())


def packed_linear(implementation: str):
    """The operator as layers call it (its C++ for CPU tensors, built), or its reference."""
    if implementation == "reference":
        return operators.packed_linear_reference
    assert ops.build(), "CI has a C++ compiler: the operators must build"
    return ops.packed_linear


@pytest.mark.parametrize("implementation", ["cpp", "reference"])
@pytest.mark.parametrize("rows", [1, 2, 7, GEMV_ROWS + 1, SMALL_BATCH, SMALL_BATCH + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_operator_finds_the_registered_packed_copy(rows, with_bias, implementation):
    """`packed_linear` uses the copy registered for a weight's address from GEMV_ROWS + 1 to
    SMALL_BATCH rows, the C mat-vec below, the plain weight above: registering another
    weight's copy shows which one it multiplied by."""
    gen = torch.Generator().manual_seed(rows)
    weight, other = torch.randn(130, 96, generator=gen), torch.randn(130, 96, generator=gen)
    bias = torch.randn(130, generator=gen) if with_bias else None
    x = torch.randn(rows, 100, generator=gen)[:, 2:98]  # strided, as activations are
    other_packed = pack_weight(other)
    register_packed(weight, other_packed)
    with torch.inference_mode():
        out = packed_linear(implementation)(x, weight, bias)
    takes_packed = gemm.GEMV_ROWS < rows <= SMALL_BATCH
    expected = F.linear(x, other if takes_packed else weight, bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("implementation", ["cpp", "reference"])
def test_a_released_packed_copy_is_not_used(implementation):
    weight, other = torch.randn(40, 24), torch.randn(40, 24)
    register_packed(weight, pack_weight(other))  # dropped at once
    gc.collect()
    x = torch.randn(GEMV_ROWS + 1, 24)  # rows that take the packed copy
    with torch.inference_mode():
        out = packed_linear(implementation)(x, weight, None)
    torch.testing.assert_close(out, x @ weight.T)


@pytest.mark.parametrize("implementation", ["cpp", "reference"])
def test_a_packed_copy_belongs_to_its_weight_not_to_its_address(implementation):
    """Another tensor at the registered weight's address (its own storage, as a freed and
    reused address would be) does not get the weight's packed copy."""
    weight, other = torch.randn(40, 24), torch.randn(40, 24)
    other_packed = pack_weight(other)
    register_packed(weight, other_packed)
    same_address = torch.from_numpy(weight.numpy())  # a new storage over the same memory
    assert same_address.data_ptr() == weight.data_ptr()
    x = torch.randn(GEMV_ROWS + 1, 24)  # rows that take the packed copy
    run = packed_linear(implementation)
    with torch.inference_mode():
        torch.testing.assert_close(run(x, weight, None), x @ other.T)
        # An alias of the weight (as a compiled graph may pass it) shares its storage.
        torch.testing.assert_close(run(x, weight.detach(), None), x @ other.T)
        torch.testing.assert_close(run(x, same_address, None), x @ weight.T)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_mat_vecs_of_one_region_each_match_torch(rows):
    """`gemv_each_f32` (the benchmarks' floor) multiplies every matrix by its own input."""
    gen = torch.Generator().manual_seed(rows)
    weights = [torch.randn(out, inner, generator=gen) for out, inner in [(6, 40), (33, 7), (8, 8)]]
    inputs = [torch.randn(rows, w.shape[1], generator=gen) for w in weights]
    outputs = [torch.empty(rows, w.shape[0]) for w in weights]
    multiply = gemm.gemv_each(weights, inputs, outputs)
    assert multiply is not None, "CI has a C compiler: the mat-vec must build"
    multiply()
    for weight, x, y in zip(weights, inputs, outputs, strict=True):
        torch.testing.assert_close(y, F.linear(x, weight), rtol=1e-5, atol=1e-4)
