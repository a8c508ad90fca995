"""The CPU state-update kernel against the torch reference, eager and in the compiled step."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridserve import kernels
from hybridserve.kernels import dispatch
from hybridserve.kernels.cpu import library, ops, state_update
from hybridserve.kernels.reference import selective_state_update_ref
from hybridserve.kernels.reference._common import prepare_dt

SLOTS, LAYERS, LAYER, H, P, N, G = 9, 3, 1, 8, 16, 32, 2
# Out of order, with a padding row: the kernel must not assume the runner's sorted run.
ROW_SLOTS = [4, -1, 0, 7, 2]


def make_inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = len(ROW_SLOTS)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "pool": randn(SLOTS, LAYERS, H, P, N),
        # x is a column slice of a wider projection in the model: not contiguous.
        "x": randn(rows, H, P + 3)[:, :, 1 : P + 1],
        "dt": randn(rows, H),
        "A": -torch.rand(H, generator=gen),
        "B": randn(rows, G, N),
        "C": randn(rows, G, N),
        "D": randn(H),
        "dt_bias": randn(H),
    }


def run(update, inputs: dict[str, torch.Tensor], pool: torch.Tensor) -> torch.Tensor:
    return update(
        pool[:, LAYER],
        inputs["x"],
        inputs["dt"],
        inputs["A"],
        inputs["B"],
        inputs["C"],
        state_slots=torch.tensor(ROW_SLOTS),
        D=inputs["D"],
        dt_bias=inputs["dt_bias"],
        dt_softplus=True,
        dt_limit=(0.0, 4.0),
    )


def test_the_kernel_is_built_here():
    # CI has a C compiler (the compiled decode step needs one too): a missing kernel is a bug.
    assert state_update.build()


@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_matches_the_reference_in_place_and_skips_padding(seed):
    inputs = make_inputs(seed)
    pool, expected_pool = inputs["pool"].clone(), inputs["pool"].clone()
    y = run(state_update.selective_state_update, inputs, pool)
    expected = run(selective_state_update_ref, inputs, expected_pool)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert not y[1].any(), "a padding row outputs zeros"
    torch.testing.assert_close(pool, expected_pool, rtol=1e-5, atol=1e-5)
    assert not torch.equal(pool, inputs["pool"]), "the states were updated"


def test_the_operator_matches_the_reference_in_place():
    """`ops.ssm_update_` (C++ calling the kernel) on the whole pool, dt prepared."""
    assert ops.build()
    inputs = make_inputs(5)
    pool, expected_pool = inputs["pool"].clone(), inputs["pool"].clone()
    dt = prepare_dt(inputs["dt"], inputs["dt_bias"], True, (0.0, 4.0))
    args = [inputs[k] for k in ("x",)] + [dt] + [inputs[k] for k in ("A", "B", "C")]
    y = ops.ssm_update_(pool, LAYER, *args, torch.tensor(ROW_SLOTS), inputs["D"])
    expected = run(selective_state_update_ref, inputs, expected_pool)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, expected_pool, rtol=1e-5, atol=1e-5)
    assert not torch.equal(pool, inputs["pool"]), "the states were updated"


def test_cpu_tensors_dispatch_to_the_kernel(monkeypatch):
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    calls = []
    kernel = state_update.selective_state_update
    monkeypatch.setattr(
        state_update,
        "selective_state_update",
        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs),
    )
    monkeypatch.setattr(dispatch, "implementation", dispatch.implementation.__wrapped__)
    inputs = make_inputs(2)
    run(kernels.selective_state_update, inputs, inputs["pool"])
    assert calls == [1]


@torch.inference_mode()
def test_the_compiled_step_updates_the_pool_in_place_through_the_kernel():
    """`state_update_pooled` compiled (the operator is opaque to the compiler; its C++ calls
    the kernel) against the reference on the layer's view."""
    assert ops.build()
    inputs = make_inputs(3)
    rows = torch.tensor([5, 0, 3, 8])  # every row real: the compiled step has no padding
    args = [inputs[k][: len(rows)] for k in ("x", "dt")]
    args += [inputs["A"], inputs["B"][: len(rows)], inputs["C"][: len(rows)]]
    options = {"D": inputs["D"], "dt_bias": inputs["dt_bias"], "dt_softplus": True}
    options["dt_limit"] = (0.0, 4.0)

    pool = inputs["pool"].clone()
    compiled = torch.compile(kernels.state_update_pooled, dynamic=True, fullgraph=True)
    y = compiled(pool, LAYER, *args, state_slots=rows, **options)

    expected_pool = inputs["pool"].clone()
    expected = selective_state_update_ref(
        expected_pool[:, LAYER], *args, state_slots=rows, **options
    )
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, expected_pool, rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_reference_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(library, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(library, "_functions", {})
    library.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=library.__name__):
            assert not state_update.build()
        assert "state_update: the build failed, torch runs instead" in caplog.text
        inputs = make_inputs(4)
        pool, expected_pool = inputs["pool"].clone(), inputs["pool"].clone()
        y = run(state_update.selective_state_update, inputs, pool)
        expected = run(selective_state_update_ref, inputs, expected_pool)
        assert torch.equal(y, expected) and torch.equal(pool, expected_pool)
    finally:
        library.load.cache_clear()
