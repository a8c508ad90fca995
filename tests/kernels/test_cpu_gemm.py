"""oneDNN-packed small-batch linear equals the plain linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels.cpu_gemm import SMALL_BATCH, can_pack, linear, pack_weight

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
