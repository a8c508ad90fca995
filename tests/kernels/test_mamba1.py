"""The Mamba1 selective scan's reference kernels against a float64 recurrence written out token
by token: the prompt scan over packed sequences (slots read and written in a strided pool) and
the decode step. `check_scan` and `check_step` serve the CPU and Triton kernels' tests too."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.kernels.reference import mamba1_scan_ref, mamba1_step_ref

CHANNELS, N = 70, 12  # more channels than one kernel block, N not a power of two
NUM_SLOTS, NUM_LAYERS, LAYER = 8, 2, 1
LENGTHS = [1, 5, 33, 80]
# Sequence i starts from slot INITIAL[i] (-1: zero) and ends in FINAL[i] (-1: not written);
# sequence 1 reads and writes one slot.
INITIAL = [-1, 3, 2, -1]
FINAL = [6, 3, -1, 0]
TOL = 2e-5


def make_inputs(num_tokens: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    # x | dt come out of wider rows (strided, as the model's splits give them).
    wide = randn(num_tokens, 2 * CHANNELS + 3)
    return {
        "x": wide[:, :CHANNELS],
        "dt": wide[:, CHANNELS : 2 * CHANNELS] - 1.0,
        "A": -torch.exp(randn(CHANNELS, N) * 0.5),
        "B": randn(num_tokens, N),
        "C": randn(num_tokens, N),
        "D": randn(CHANNELS),
        "dt_bias": randn(CHANNELS) * 0.5,
        "pool": randn(NUM_SLOTS, NUM_LAYERS, CHANNELS, N) * 0.3,
    }


def oracle(case: dict, tokens: slice | list[int], state: torch.Tensor):
    """One sequence, one token at a time, in float64: (outputs (L, D), final state)."""
    h = state.double()
    A, D = case["A"].double(), case["D"].double()
    outs = []
    indices = range(tokens.start, tokens.stop) if isinstance(tokens, slice) else tokens
    for t in indices:
        x = case["x"][t].double()
        delta = F.softplus(case["dt"][t].double() + case["dt_bias"].double())
        h = torch.exp(delta[:, None] * A) * h + (delta * x)[:, None] * case["B"][t].double()
        outs.append(h @ case["C"][t].double() + D * x)
    return torch.stack(outs), h


def check_scan(scan, tol: float = TOL) -> None:
    """Run `scan` (the reference's signature) on packed sequences; compare outputs and final
    states with the oracle, and check nothing else in the pool moved."""
    case = make_inputs(sum(LENGTHS))
    pool = case["pool"]
    before = pool.clone()
    offsets = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    out = scan(
        case["x"],
        case["dt"],
        case["A"],
        case["B"],
        case["C"],
        cu_seqlens=torch.tensor(offsets),
        ssm_states=pool[:, LAYER],
        initial_state_slots=torch.tensor(INITIAL),
        final_state_slots=torch.tensor(FINAL),
        D=case["D"],
        dt_bias=case["dt_bias"],
    )
    assert out.shape == case["x"].shape and out.dtype == case["x"].dtype
    for s, (first, last) in enumerate(zip(INITIAL, FINAL, strict=True)):
        span = slice(offsets[s], offsets[s + 1])
        start = before[first, LAYER] if first >= 0 else torch.zeros(CHANNELS, N)
        expected, final = oracle(case, span, start)
        assert (out[span].double() - expected).abs().max() <= tol, s
        if last >= 0:
            assert (pool[last, LAYER].double() - final).abs().max() <= tol, s
    written = {slot for slot in FINAL if slot >= 0}
    untouched = [i for i in range(NUM_SLOTS) if i not in written]
    assert torch.equal(pool[untouched], before[untouched])
    assert torch.equal(pool[:, 1 - LAYER], before[:, 1 - LAYER])


def check_step(step, tol: float = TOL) -> None:
    """Decode rows in an arbitrary slot order with a padding row, three tokens in a row."""
    rows = 5
    case = make_inputs(3 * rows, seed=1)
    pool = case["pool"]
    before = pool.clone()
    slots = torch.tensor([5, -1, 0, 7, 2])
    expected = {s: before[s, LAYER].double() for s in slots.tolist() if s >= 0}
    for t in range(3):
        span = slice(t * rows, (t + 1) * rows)
        names = ("x", "dt", "A", "B", "C")
        args = [case[n][span] if n != "A" else case[n] for n in names]
        out = step(pool[:, LAYER], *args, state_slots=slots, D=case["D"], dt_bias=case["dt_bias"])
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padding row
        for row, slot in enumerate(slots.tolist()):
            if slot >= 0:
                token_out, expected[slot] = oracle(case, [t * rows + row], expected[slot])
                assert (out[row].double() - token_out[0]).abs().max() <= tol
    for slot, state in expected.items():
        assert (pool[slot, LAYER].double() - state).abs().max() <= tol
    untouched = [i for i in range(NUM_SLOTS) if i not in expected]
    assert torch.equal(pool[untouched], before[untouched])


def test_the_prompt_scan_equals_the_token_by_token_recurrence():
    check_scan(mamba1_scan_ref)


def test_the_decode_step_equals_the_recurrence_and_skips_padding_rows():
    check_step(mamba1_step_ref)
