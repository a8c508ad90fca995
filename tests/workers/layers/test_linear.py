"""A packed linear layer multiplies through the `packed_linear` operator, eagerly and
compiled, and a layer it cannot pack through the dispatched GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import can_pack
from hybridserve.workers.layers import linear as linear_module
from hybridserve.workers.layers.linear import ColumnParallelLinear

pytestmark = pytest.mark.skipif(
    not can_pack(torch.zeros(1, 1)), reason="this torch build has no oneDNN linear"
)


def make_layer(dtype: torch.dtype = torch.float32) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(48, [(0, 70)], bias=True, dtype=dtype, device="cpu")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(70, 48, generator=torch.Generator().manual_seed(0)))
        layer.bias.copy_(torch.linspace(-1, 1, 70))
    return layer


@pytest.mark.parametrize("rows", [1, 5, 100])
def test_a_packed_layer_calls_the_operator_and_matches_torch(rows, monkeypatch):
    layer = make_layer()
    layer.pack_for_cpu()
    assert layer.is_packed
    calls = []
    operator = linear_module.packed_linear
    monkeypatch.setattr(linear_module, "packed_linear", lambda *a: calls.append(1) or operator(*a))
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        y = layer(x)
    assert calls == [1]
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


def test_the_compiled_layer_calls_the_same_operator_and_an_unpacked_one_the_gemm(monkeypatch):
    """Compiled in one graph (the operator is opaque to the compiler) it gives the eager
    layer's numbers; a bf16 layer is not packed and never calls the operator."""
    layer = make_layer()
    layer.pack_for_cpu()
    x = torch.randn(5, 48)
    with torch.inference_mode():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(eager, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-4)

    monkeypatch.setattr(linear_module, "packed_linear", lambda *a: pytest.fail("operator called"))
    plain = make_layer(torch.bfloat16)
    plain.pack_for_cpu()
    assert plain.packed is None and not plain.is_packed
    with torch.inference_mode():
        y = plain(x.bfloat16())
    torch.testing.assert_close(y, F.linear(x.bfloat16(), plain.weight, plain.bias))
