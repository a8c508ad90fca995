"""Triton mamba_chunk_scan against mamba_chunk_scan_ref.

Inputs are laid out as in a Mamba2 layer: x, B, C and dt are column slices of one wide projection
(strided rows), and the state pool of a layer is the strided view pool[:, LAYER] of a
(num_slots, num_layers, H, P, N) tensor. Kernel and reference run on separate copies of the
pool; every slot the reference does not write, and the other layer, must stay bit for bit.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from hybridserve.kernels.reference import mamba_chunk_scan_ref
from hybridserve.kernels.triton.ssd import mamba_chunk_scan

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_SLOTS, NUM_LAYERS, LAYER = 8, 2, 1
# Per input dtype. 16-bit inputs leave out and the states' tf32 dots on a GPU at ~1e-3.
TOL = {torch.float32: 1e-4, torch.float16: 5e-3}


def make_inputs(lens, H, G, P, N, dtype, *, pool_dtype=torch.float32, positive_dt=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    # One in_proj-like row per token: | x (H*P) | B (G*N) | C (G*N) | dt (H) | spare |
    widths = [H * P, G * N, G * N, H]
    proj = torch.randn(T, sum(widths) + 3, generator=gen)
    if positive_dt:  # without softplus, dt must be a valid step on its own
        proj[:, -H - 3 : -3] = torch.rand(T, H, generator=gen) * 0.5
    proj = proj.to(dtype)
    x, B, C, dt = proj[:, :-3].split(widths, dim=1)
    return dict(
        x=x.view(T, H, P),
        dt=dt,
        A=-torch.exp(torch.rand(H, generator=gen)),
        B=B.view(T, G, N),
        C=C.view(T, G, N),
        cu_seqlens=torch.tensor([0, *lens]).cumsum(0).to(torch.int32),
        D=torch.randn(H, generator=gen),
        dt_bias=torch.randn(H, generator=gen) * 0.5,
        pool=torch.randn(NUM_SLOTS, NUM_LAYERS, H, P, N, generator=gen).to(pool_dtype),
    )


def run_both(inp, initial, final, **kwargs):
    """Kernel on inp["pool"], reference on a copy: (result, expected, pool before, ref pool)."""
    inp = {k: v.to(DEVICE) for k, v in inp.items()}
    inp["pool"] = inp["pool"].clone()  # the caller's pool stays as it was
    before, pool_ref = inp["pool"].clone(), inp["pool"].clone()
    slots = dict(
        initial_state_slots=torch.tensor(initial, device=DEVICE),
        final_state_slots=torch.tensor(final, device=DEVICE),
    )
    if kwargs.get("state_positions") is not None:
        kwargs["state_positions"] = kwargs["state_positions"].to(DEVICE)
    args = [inp[k] for k in ("x", "dt", "A", "B", "C")]
    common = dict(cu_seqlens=inp["cu_seqlens"], **slots, **kwargs)
    result = mamba_chunk_scan(*args, ssm_states=inp["pool"][:, LAYER], **common)
    expected = mamba_chunk_scan_ref(*args, ssm_states=pool_ref[:, LAYER], **common)
    return result, expected, before, inp["pool"], pool_ref


def check_pool(pool, pool_ref, before, final, tol):
    """Written slots match the reference; every other slot and layer is unchanged bit for bit."""
    written = sorted({s for s in final if s >= 0})
    untouched = [s for s in range(NUM_SLOTS) if s not in written]
    torch.testing.assert_close(
        pool[written, LAYER].float(), pool_ref[written, LAYER].float(), rtol=tol, atol=tol
    )
    assert torch.equal(pool[untouched], before[untouched])
    other_layers = [layer for layer in range(NUM_LAYERS) if layer != LAYER]
    assert torch.equal(pool[:, other_layers], before[:, other_layers])


# Lengths (chunk 16): a single token, shorter than a chunk, exactly one chunk, two chunks and a
# tail of 5, one chunk and a tail of 1.
LENS = [1, 13, 16, 37, 17]
# Sequence 0 reads slot 3, which sequence 3 writes, and sequence 3 reads slot 5, which sequence
# 1 writes: both must see the pool as it was. Sequence 4 reads and writes slot 2 itself.
INITIAL, FINAL = [3, -1, 7, 5, 2], [-1, 5, 6, 3, 2]
# Rows (seq, pos) in no particular order: first token, chunk boundaries (16, 32), sequence ends
# (1, 13, 16, 37, 17), a tail lane (33), the lane after a boundary (17), a repeated row.
POSITIONS = [[3, 32], [0, 1], [3, 16], [1, 13], [3, 37], [2, 16], [4, 17], [3, 33], [4, 16]]
POSITIONS += [[1, 4], [3, 17], [3, 32]]

CASES = {
    # name: (H, G, P, N, chunk_size, kwargs)
    "full": (6, 3, 8, 12, 16, {"D": True, "dt_bias": True, "dt_limit": (0.05, 1.2)}),
    "bare": (4, 2, 16, 16, 32, {}),
    "no_softplus": (4, 2, 12, 8, 16, {"D": True, "dt_softplus": False}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_scan_matches_reference(dtype, case):
    H, G, P, N, chunk_size, options = CASES[case]
    inp = make_inputs(LENS, H, G, P, N, dtype, positive_dt=case == "no_softplus")
    kwargs = dict(options, chunk_size=chunk_size, state_positions=torch.tensor(POSITIONS))
    for name in ("D", "dt_bias"):
        kwargs[name] = inp[name].to(DEVICE) if kwargs.pop(name, False) else None

    result, expected, before, pool, pool_ref = run_both(inp, INITIAL, FINAL, **kwargs)

    tol = TOL[dtype]
    assert result.out.dtype == dtype and result.out.shape == inp["x"].shape
    torch.testing.assert_close(result.out.float(), expected.out.float(), rtol=tol, atol=tol)
    assert result.position_states.dtype == torch.float32
    torch.testing.assert_close(result.position_states, expected.position_states, rtol=tol, atol=tol)
    check_pool(pool, pool_ref, before, FINAL, tol)


def test_fp16_state_pool_without_positions():
    # The pool keeps its dtype; no cross-sequence slot sharing, so the kernel reads the pool in
    # place (no snapshot), and one sequence reads and writes its own slot.
    inp = make_inputs([21, 2, 9], 4, 2, 8, 16, torch.float32, pool_dtype=torch.float16, seed=1)
    initial, final = [4, 4, -1], [4, -1, 1]

    result, expected, before, pool, pool_ref = run_both(
        inp, initial, final, chunk_size=16, D=inp["D"].to(DEVICE), dt_limit=(0.0, 0.5)
    )

    assert result.position_states is None
    torch.testing.assert_close(result.out, expected.out, rtol=1e-4, atol=1e-4)
    assert pool.dtype == torch.float16
    check_pool(pool, pool_ref, before, final, 2e-3)


def test_split_prefill_continues_from_the_written_state():
    # A prompt split after 11 tokens (not a chunk multiple): the second call starts from the
    # slot the first wrote and overwrites it; outputs and final state match one call.
    inp = make_inputs([29], 4, 2, 8, 8, torch.float32, seed=2)
    once, _, _, pool_once, _ = run_both(inp, [1], [6], chunk_size=16)

    pool = inp["pool"].to(DEVICE)
    outs = []
    for start, end, initial in ((0, 11, 1), (11, 29, 6)):
        part = {k: inp[k][start:end].to(DEVICE) for k in ("x", "dt", "B", "C")}
        result = mamba_chunk_scan(
            part["x"],
            part["dt"],
            inp["A"].to(DEVICE),
            part["B"],
            part["C"],
            chunk_size=16,
            cu_seqlens=torch.tensor([0, end - start], device=DEVICE),
            ssm_states=pool[:, LAYER],
            initial_state_slots=torch.tensor([initial], device=DEVICE),
            final_state_slots=torch.tensor([6], device=DEVICE),
        )
        outs.append(result.out)

    torch.testing.assert_close(torch.cat(outs), once.out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool, pool_once, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [[0, 0], [0, 4], [2, 1]])
def test_state_position_outside_sequence_is_rejected(bad):
    inp = make_inputs([3, 2], 4, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="state_positions row 0"):
        run_both(inp, [-1, -1], [-1, -1], chunk_size=16, state_positions=torch.tensor([bad]))


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from hybridserve.kernels.triton.ssd import _mamba_chunk_scan_kernel

kernel = _mamba_chunk_scan_kernel.fn  # under the heuristics
OPTIONAL = ("D", "dt_bias", "pos_offsets", "pos_values", "pos_rows", "pos_states")
POINTERS = dict(A="fp32", D="fp32", dt_bias="fp32", init_states="fp32", final_states="fp32",
                pos_states="fp32", cu_seqlens="i32", init_slots="i32", final_slots="i32",
                pos_offsets="i32", pos_values="i32", pos_rows="i32")
for dtype, optional, BN, num_warps in (("fp32", True, 16, 4), ("bf16", False, 128, 8)):
    constants = dict(BT=32, BP=32, BN=BN, DT_SOFTPLUS=True, HAS_D=optional, HAS_DT_BIAS=optional,
                     HAS_POSITIONS=optional, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    if not optional:
        constants.update(dict.fromkeys(OPTIONAL))
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("x", "dt", "B", "C", "out"):
            signature[name] = "*" + dtype
        elif name in POINTERS:
            signature[name] = "*" + POINTERS[name]
        else:
            signature[name] = "fp32" if name in ("dt_min", "dt_max") else "i32"
    src = triton.compiler.ASTSource(kernel, signature, constants)
    target = GPUTarget("cuda", 90, 32)
    compiled = triton.compile(src, target=target, options={"num_warps": num_warps})
    assert compiled.asm["cubin"]
print("compiled")
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the value tests above already compile on the GPU")
def test_kernel_compiles_for_hopper():
    # The interpreter skips Triton's compiler, whose typing rules (loop-carried values, branch
    # results, dot operand types) are stricter. Compile for sm_90 in a fresh process without
    # TRITON_INTERPRET (the interpreter patches triton.language in this one); no GPU needed.
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


def test_softplus_threshold_and_clamp_match_torch():
    # dt + dt_bias from far below 0 to far above softplus's threshold (20) and where exp()
    # overflows in float32 (> 88): torch returns dt itself there. The lower limit lifts the
    # near-zero steps.
    inp = make_inputs([9], 2, 1, 8, 8, torch.float32, seed=3)
    inp["dt"] = torch.linspace(-100.0, 120.0, 9 * 2).view(9, 2)
    kwargs = dict(chunk_size=16, dt_bias=inp["dt_bias"].to(DEVICE), dt_limit=(0.3, math.inf))
    result, expected, *_ = run_both(inp, [-1], [-1], **kwargs)
    assert result.out.isfinite().all()
    torch.testing.assert_close(result.out, expected.out, rtol=1e-4, atol=1e-4)
