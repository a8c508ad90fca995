"""Triton gated_rms_norm against gated_rms_norm_ref."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.reference import gated_rms_norm_ref
from hybridserve.kernels.triton import norm as triton_norm
from tests.kernels.triton.device import on_device

pytestmark = pytest.mark.triton

gated_rms_norm = on_device(triton_norm.gated_rms_norm)

TOL = {torch.float32: 1e-5, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(
    ("hidden", "group_size"),
    [(24, 6), (24, 24), (16, 8)],  # several groups (6 is masked to 8), one group, powers of two
)
def test_matches_reference(dtype, gated, hidden, group_size):
    gen = torch.Generator().manual_seed(0)
    # x and gate are column slices of one projection, as in Mamba2: strided rows.
    proj = (torch.randn(2, 3, 2 * hidden, generator=gen) * 2).to(dtype)
    x, gate = proj[..., :hidden], proj[..., hidden:]
    weight = torch.randn(hidden, generator=gen).to(dtype)
    gate = gate if gated else None

    out = gated_rms_norm(x, gate, weight, group_size=group_size, eps=1e-5)
    expected = gated_rms_norm_ref(x, gate, weight, group_size=group_size, eps=1e-5)

    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])


def test_groups_are_normalised_separately():
    # Scaling one group must not change the other group's output.
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    weight = torch.ones(8)
    scaled = x.clone()
    scaled[:, 4:] *= 100.0
    a = gated_rms_norm(x, None, weight, group_size=4, eps=1e-6)
    b = gated_rms_norm(scaled, None, weight, group_size=4, eps=1e-6)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    torch.testing.assert_close(a[:, 4:], b[:, 4:], rtol=1e-4, atol=1e-4)  # scale-invariant
    torch.testing.assert_close(
        a, gated_rms_norm_ref(x, None, weight, group_size=4, eps=1e-6), rtol=1e-5, atol=1e-5
    )


def test_empty_rows():
    out = gated_rms_norm(
        torch.zeros(0, 8), torch.zeros(0, 8), torch.ones(8), group_size=4, eps=1e-5
    )
    assert out.shape == (0, 8)
