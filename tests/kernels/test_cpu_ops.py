"""The CPU operators' C++ build, and what runs without it."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridserve.kernels import c_library, cpu_ops
from hybridserve.kernels.reference.pooled import attention_decode_pooled, state_update_pooled


def test_the_operators_are_built_here():
    # CI has a C++ compiler (the compiled decode step needs one too): a failed build is a bug.
    assert cpu_ops.build() and cpu_ops.loaded()


def test_a_failed_build_is_logged_and_reported(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setattr(c_library, "CACHE_DIR", tmp_path)
    with caplog.at_level(logging.WARNING, logger=c_library.__name__):
        assert not c_library.load_torch_operators.__wrapped__("probe", cpu_ops.SOURCE)
    assert "probe: the build failed, torch runs instead" in caplog.text
    assert not list(tmp_path.rglob("*.so"))


def _fail(*args: object) -> None:
    pytest.fail("an operator without its C++ implementation was called")


@torch.inference_mode()
def test_without_the_operators_the_pooled_kernels_run_torch(monkeypatch):
    """What the compiled step traces when `build()` failed: torch code (the compiled-step
    tests of the state update and the attention compare its numbers with the kernels')."""
    monkeypatch.setattr(cpu_ops, "_loaded", False)
    monkeypatch.setattr(cpu_ops, "ssm_update_", _fail)
    monkeypatch.setattr(cpu_ops, "attention_decode", _fail)
    gen = torch.Generator().manual_seed(0)
    H, P, N = 4, 8, 16
    ssm_pool = torch.randn(5, 2, H, P, N, generator=gen)
    x, dt = torch.randn(3, H, P, generator=gen), torch.randn(3, H, generator=gen)
    A, B, C = -torch.rand(H, generator=gen), *torch.randn(2, 3, 1, N, generator=gen)
    slots = torch.tensor([4, 0, 2])
    options = {"D": None, "dt_bias": None, "dt_softplus": True, "dt_limit": (0.0, 9.0)}
    state_update_pooled(ssm_pool, 1, x, dt, A, B, C, state_slots=slots, **options)

    kv_pool = torch.randn(6, 2, 2, 2, 4, 8, generator=gen)
    q = torch.randn(3, 4, 8, generator=gen)
    tables, seq_lens = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([5, 8, 1])
    options = {"block_tables": tables, "seq_lens": seq_lens, "scale": 0.3}
    assert attention_decode_pooled(q, kv_pool, 1, **options).shape == q.shape
