"""The CPU operators' C++ build, and what runs without it."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridserve.kernels.cpu import library, ops


def test_the_operators_are_built_here():
    # CI has a C++ compiler (the compiled decode step needs one too): a failed build is a bug.
    assert ops.build()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("hybridserve::ssm_update_", "CPU")


def test_a_failed_build_is_logged_and_reported(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setattr(library, "CACHE_DIR", tmp_path)
    with caplog.at_level(logging.WARNING, logger=library.__name__):
        assert not library.load_torch_operators.__wrapped__("ops.cpp")
    assert "ops: the build failed, torch runs instead" in caplog.text
    assert not list(tmp_path.rglob("*.so"))


OPERATORS = ["packed_linear", "conv_update_", "ssm_update_", "store_kv_", "attention_decode"]


@pytest.mark.parametrize("name", OPERATORS)
def test_each_operator_has_a_reference_for_every_device_and_c_plus_plus_for_the_cpu(name):
    """The reference (kernels/operators.py) serves any tensor, CUDA included; once built, the
    C++ serves CPU tensors (torch prefers a backend's own kernel to the composite one)."""
    assert ops.build()
    qualified = f"hybridserve::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeExplicitAutograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")
