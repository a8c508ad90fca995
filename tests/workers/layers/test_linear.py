"""A packed linear layer multiplies through the C++ operator, eagerly and compiled, and
through torch when the operator cannot hold its packed copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels import cpu_gemm, cpu_ops
from hybridserve.workers.layers.linear import ColumnParallelLinear

pytestmark = pytest.mark.skipif(
    not cpu_gemm.can_pack(torch.zeros(1, 1)), reason="this torch build has no oneDNN linear"
)


def make_layer() -> ColumnParallelLinear:
    layer = ColumnParallelLinear(48, [(0, 70)], bias=True, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(70, 48, generator=torch.Generator().manual_seed(0)))
        layer.bias.copy_(torch.linspace(-1, 1, 70))
    return layer


@pytest.mark.parametrize("rows", [1, 5, 100])
def test_a_packed_layer_calls_the_operator_and_matches_torch(rows, monkeypatch):
    layer = make_layer()
    layer.pack_for_cpu()
    assert layer.is_packed, "CI has a C++ compiler: the operator must hold the packed copy"
    calls = []
    operator = cpu_ops.packed_linear
    monkeypatch.setattr(cpu_ops, "packed_linear", lambda *a: calls.append(1) or operator(*a))
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        y = layer(x)
    assert calls == [1]
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


def test_without_the_operator_the_layer_multiplies_in_python(monkeypatch):
    monkeypatch.setattr(cpu_ops, "register_packed", lambda weight, packed: False)
    monkeypatch.setattr(cpu_ops, "packed_linear", lambda *a: pytest.fail("operator called"))
    layer = make_layer()
    layer.pack_for_cpu()
    assert layer.packed is not None and not layer.is_packed
    x = torch.randn(5, 48)
    with torch.inference_mode():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(eager, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-4)
