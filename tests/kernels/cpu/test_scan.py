"""The CPU prompt scan (the recurrence token by token) against the chunked torch reference."""

from __future__ import annotations

import pytest
import torch

from hybridserve import kernels
from hybridserve.kernels.cpu import scan
from hybridserve.kernels.reference import mamba_chunk_scan_ref

SLOTS, H, P, N, G = 8, 4, 16, 8, 2
LENGTHS = [1, 5, 70, 130]  # one token, shorter than a chunk, a chunk and a bit, two chunks
# Sequence 1 reads slot 3 and sequence 2 writes it: every read comes before any write.
INITIAL = [-1, 3, 5, -1]
FINAL = [2, 6, 3, -1]
# (sequence, tokens scanned): the first token, chunk boundaries, the last token, two at once.
POSITIONS = [(2, 64), (0, 1), (3, 130), (2, 1), (3, 64), (3, 65), (2, 70), (2, 70)]


def make_inputs(seed: int, with_d: bool) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        # x as a column slice of a wider projection: not contiguous.
        "x": randn(T, H, P + 2)[:, :, 1 : P + 1],
        "dt": randn(T, H),
        "A": -torch.rand(H, generator=gen) - 0.1,
        "B": randn(T, G, N),
        "C": randn(T, G, N),
        "kwargs": {
            "chunk_size": 64,
            "cu_seqlens": torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()]),
            "initial_state_slots": torch.tensor(INITIAL),
            "final_state_slots": torch.tensor(FINAL),
            "D": randn(H) if with_d else None,
            "dt_bias": randn(H),
            "dt_limit": (0.0, 2.0),
            "state_positions": torch.tensor(POSITIONS),
        },
        "pool": randn(SLOTS, H, P, N),
    }


@pytest.mark.parametrize("with_d", [True, False])
def test_the_kernel_equals_the_reference(with_d):
    assert scan.kernel() is not None, "the C kernel did not build"
    inputs = make_inputs(seed=3, with_d=with_d)
    args = [inputs[name] for name in ("x", "dt", "A", "B", "C")]
    ours_pool, theirs_pool = inputs["pool"].clone(), inputs["pool"].clone()
    ours = scan.mamba_chunk_scan(*args, ssm_states=ours_pool, **inputs["kwargs"])
    theirs = mamba_chunk_scan_ref(*args, ssm_states=theirs_pool, **inputs["kwargs"])
    torch.testing.assert_close(ours.out, theirs.out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.position_states, theirs.position_states, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_pool, theirs_pool, rtol=1e-4, atol=1e-4)
    # Slots nobody writes are untouched.
    for slot in set(range(SLOTS)) - set(FINAL):
        assert torch.equal(ours_pool[slot], inputs["pool"][slot])


def test_a_strided_layer_view_of_the_pool_is_written_in_place():
    """The model passes one layer's (num_slots, H, P, N) view of a (slots, layers, ...) pool."""
    inputs = make_inputs(seed=4, with_d=True)
    args = [inputs[name] for name in ("x", "dt", "A", "B", "C")]
    pools = torch.randn(SLOTS, 3, H, P, N, generator=torch.Generator().manual_seed(5))
    expected = pools.clone()
    kwargs = inputs["kwargs"] | {"state_positions": None}
    ours = kernels.mamba_chunk_scan(*args, ssm_states=pools[:, 1], **kwargs)
    theirs = mamba_chunk_scan_ref(*args, ssm_states=expected[:, 1], **kwargs)
    assert ours.position_states is None
    torch.testing.assert_close(ours.out, theirs.out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pools, expected, rtol=1e-4, atol=1e-4)


def test_half_precision_states_fall_back_to_the_reference():
    inputs = make_inputs(seed=6, with_d=True)
    args = [inputs[name] for name in ("x", "dt", "A", "B", "C")]
    pool = inputs["pool"].half()
    expected = pool.clone()
    ours = scan.mamba_chunk_scan(*args, ssm_states=pool, **inputs["kwargs"])
    theirs = mamba_chunk_scan_ref(*args, ssm_states=expected, **inputs["kwargs"])
    assert torch.equal(ours.out, theirs.out) and torch.equal(pool, expected)
