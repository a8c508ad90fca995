"""The CPU Mamba1 kernels (csrc/mamba1.c) against the float64 recurrence, and their fall back to
the reference for pools they do not take."""

from __future__ import annotations

import torch

from hybridserve.kernels.cpu import library, mamba1
from hybridserve.kernels.reference import mamba1_step_ref
from tests.kernels.test_mamba1 import LAYER, check_scan, check_step, make_inputs


def test_the_c_kernels_build():
    assert library.function("mamba1.c", "mamba1_step_f32", mamba1._STEP_ARGS) is not None
    assert library.function("mamba1.c", "mamba1_scan_f32", mamba1._SCAN_ARGS) is not None


def test_the_prompt_scan_equals_the_recurrence():
    check_scan(mamba1.mamba1_scan)


def test_the_decode_step_equals_the_recurrence_and_skips_padding_rows():
    check_step(mamba1.mamba1_step)


def test_a_bfloat16_pool_runs_the_reference():
    """States the kernels cannot update in place (not fp32) go through the reference."""
    case = make_inputs(3)
    pool = case["pool"].to(torch.bfloat16)
    expected_pool = pool.clone()
    args = [case["x"], case["dt"], case["A"], case["B"], case["C"]]
    slots = torch.tensor([4, -1, 1])
    ours = mamba1.mamba1_step(pool[:, LAYER], *args, state_slots=slots, D=case["D"])
    reference = mamba1_step_ref(expected_pool[:, LAYER], *args, state_slots=slots, D=case["D"])
    assert torch.equal(ours, reference) and torch.equal(pool, expected_pool)
