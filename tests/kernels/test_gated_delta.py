"""The gated delta rule's reference kernels against a float64 recurrence written out token by
token: the chunked prompt form over packed sequences (slots read and written in a strided
pool) and the decode step."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.reference import gated_delta_chunk_ref, gated_delta_step_ref
from tests.kernels.gated_delta_cases import FINAL, INITIAL, LAYER, LENGTHS, make_inputs, oracle

TOL = 2e-5


def check_chunk(chunk, *, aligned=False, per_channel=False, tol=TOL):
    """Run `chunk` (a kernel with the reference's signature) on the shared cases; compare its
    outputs and final states with the oracle, and check nothing else in the pool moved."""
    case = make_inputs(LENGTHS, aligned=aligned, per_channel=per_channel)
    pool = case["pool"]
    before = pool.clone()
    states = pool[:, LAYER]
    out = chunk(
        case["q"],
        case["k"],
        case["v"],
        case["g"],
        case["beta"],
        cu_seqlens=case["cu_seqlens"],
        states=states,
        initial_state_slots=torch.tensor(INITIAL),
        final_state_slots=torch.tensor(FINAL),
    )
    assert out.shape == case["v"].shape and out.dtype == case["v"].dtype
    offsets = case["cu_seqlens"].tolist()
    for s, (first, last) in enumerate(zip(INITIAL, FINAL, strict=True)):
        span = slice(offsets[s], offsets[s + 1])
        start = before[first, LAYER] if first >= 0 else torch.zeros_like(before[0, LAYER])
        expected, final = oracle(*(case[n][span] for n in ("q", "k", "v", "g", "beta")), start)
        assert (out[span].double() - expected).abs().max() <= tol, s
        if last >= 0:
            assert (states[last].double() - final).abs().max() <= tol, s
    written = {slot for slot in FINAL if slot >= 0}
    untouched = [i for i in range(pool.shape[0]) if i not in written]
    assert torch.equal(pool[untouched], before[untouched])
    assert torch.equal(pool[:, 1 - LAYER], before[:, 1 - LAYER])


def check_step(step, *, per_channel=False, tol=TOL):
    """Decode rows in an arbitrary slot order with a padding row, four tokens in a row."""
    case = make_inputs([4] * 5, seed=1, per_channel=per_channel)
    pool = case["pool"]
    before = pool.clone()
    slots = torch.tensor([5, -1, 0, 7, 2])
    expected = {s: before[s, LAYER] for s in slots.tolist() if s >= 0}
    for t in range(4):
        rows = slice(t * 5, (t + 1) * 5)
        args = [case[n][rows] for n in ("q", "k", "v", "g", "beta")]
        out = step(pool[:, LAYER], *args, state_slots=slots)
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padding row
        for row, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            one = [a[row : row + 1] for a in args]
            token_out, expected[slot] = oracle(*one, expected[slot])
            assert (out[row].double() - token_out[0]).abs().max() <= tol
    for slot, state in expected.items():
        assert (pool[slot, LAYER].double() - state).abs().max() <= tol
    untouched = [i for i in range(pool.shape[0]) if i not in expected]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("aligned", [False, True], ids=["random", "aligned-keys"])
def test_the_chunked_form_equals_the_token_by_token_recurrence(aligned):
    check_chunk(gated_delta_chunk_ref, aligned=aligned)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_per_channel_decay_prompts_and_steps_equal_the_recurrence(per_channel):
    """Kimi Delta Attention's decay, one value per key channel (the prompt form is then the
    recurrence itself); per head, the same as above."""
    check_chunk(gated_delta_chunk_ref, per_channel=per_channel)
    check_step(gated_delta_step_ref, per_channel=per_channel)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_any_chunk_size_gives_the_same_result(chunk_size):
    def chunk(*args, **kwargs):
        return gated_delta_chunk_ref(*args, **kwargs, chunk_size=chunk_size)

    check_chunk(chunk)


def test_the_decode_step_equals_the_recurrence_and_skips_padding_rows():
    check_step(gated_delta_step_ref)
