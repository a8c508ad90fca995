"""Triton Mamba1 kernels against the float64 recurrence, on strided pool views."""

from __future__ import annotations

import pytest

from hybridserve.kernels.triton import mamba1 as triton_mamba1
from tests.kernels.test_mamba1 import check_scan, check_step
from tests.kernels.triton.device import on_device

pytestmark = pytest.mark.triton


def test_the_prompt_scan_equals_the_recurrence():
    check_scan(on_device(triton_mamba1.mamba1_scan), tol=5e-5)


def test_the_decode_step_equals_the_recurrence_and_skips_padding_rows():
    check_step(on_device(triton_mamba1.mamba1_step), tol=5e-5)
