"""The CPU gated delta kernels (csrc/gated_delta.c) against the float64 recurrence, and their
fall back to the reference for pools they do not take."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.cpu import gated_delta
from tests.kernels.gated_delta_cases import LAYER, LENGTHS, make_inputs
from tests.kernels.test_gated_delta import check_chunk, check_step


def test_the_c_kernels_build():
    assert gated_delta._step_kernel() is not None
    assert gated_delta._scan_kernel() is not None


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_the_prompt_scan_equals_the_recurrence(per_channel):
    check_chunk(gated_delta.gated_delta_chunk, per_channel=per_channel)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_the_decode_step_equals_the_recurrence_and_skips_padding_rows(per_channel):
    check_step(gated_delta.gated_delta_step, per_channel=per_channel)


def test_a_bfloat16_pool_runs_the_reference():
    """States the kernels cannot update in place (not fp32) go through the reference: same
    result as the reference itself."""
    case = make_inputs(LENGTHS[:2])
    pool = case["pool"].to(torch.bfloat16)
    expected_pool = pool.clone()
    args = [case[n] for n in ("q", "k", "v", "g", "beta")]
    slots = {
        "cu_seqlens": case["cu_seqlens"],
        "initial_state_slots": torch.tensor([-1, 3]),
        "final_state_slots": torch.tensor([6, 3]),
    }
    ours = gated_delta.gated_delta_chunk(*args, states=pool[:, LAYER], **slots)
    reference = gated_delta.gated_delta_chunk_ref(*args, states=expected_pool[:, LAYER], **slots)
    assert torch.equal(ours, reference) and torch.equal(pool, expected_pool)
