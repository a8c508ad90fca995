"""Triton gated delta kernels against the float64 recurrence, on strided pool views."""

from __future__ import annotations

import pytest

from hybridserve.kernels.triton import gated_delta as triton_gated_delta
from tests.kernels.test_gated_delta import check_chunk, check_step
from tests.kernels.triton.device import on_device

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("aligned", [False, True], ids=["random", "aligned-keys"])
def test_the_chunked_form_equals_the_recurrence(aligned):
    check_chunk(on_device(triton_gated_delta.gated_delta_chunk), aligned=aligned, tol=5e-5)


def test_per_channel_decay_runs_the_recurrence():
    check_chunk(on_device(triton_gated_delta.gated_delta_chunk), per_channel=True, tol=5e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_the_decode_step_equals_the_recurrence_and_skips_padding_rows(per_channel):
    check_step(on_device(triton_gated_delta.gated_delta_step), per_channel=per_channel)
