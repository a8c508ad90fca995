"""rms_norm_ref and gated_rms_norm_ref against the formulas written out in float64."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.reference import gated_rms_norm_ref, rms_norm_ref

DM, EPS = 32, 1e-5
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def normalise(h, eps):
    return h / torch.sqrt((h * h).mean(dim=-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm(dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 5, DM) * 3).to(dtype)
    weight = torch.randn(DM)

    out = rms_norm_ref(x, weight, EPS)

    expected = normalise(x.double(), EPS) * weight.double()
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("group_size", [8, DM])
def test_gated_rms_norm(dtype, gated, group_size):
    torch.manual_seed(1)
    x = (torch.randn(7, DM) * 3).to(dtype)
    gate = torch.randn(7, DM).to(dtype) if gated else None
    weight = torch.randn(DM)

    out = gated_rms_norm_ref(x, gate, weight, group_size=group_size, eps=EPS)

    h = x.double()
    if gated:
        g = gate.double()
        h = h * g / (1 + torch.exp(-g))
    groups = [normalise(part, EPS) for part in h.split(group_size, dim=-1)]
    expected = torch.cat(groups, dim=-1) * weight.double()
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, rtol=TOL[dtype], atol=TOL[dtype])
