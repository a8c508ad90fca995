"""Backend choice: Triton for CUDA tensors, the reference on the CPU, or forced by env."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridserve import kernels
from hybridserve.kernels import dispatch
from hybridserve.kernels.dispatch import BACKEND_ENV, TRITON_MODULES, kernel_backend


def test_cpu_tensors_use_the_cpu_backend(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert kernel_backend(torch.zeros(1)) == "cpu"


@pytest.mark.parametrize("forced", ["triton", "cpu", "reference"])
def test_the_environment_forces_a_backend(monkeypatch, forced):
    monkeypatch.setenv(BACKEND_ENV, forced)
    assert kernel_backend(torch.zeros(1)) == forced


def test_an_unknown_backend_is_an_error_listing_the_choices(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(
        ValueError, match=r"not a kernel backend \(choose one of: triton, cpu, reference\)"
    ):
        kernel_backend(torch.zeros(1))


def test_forced_triton_calls_the_triton_kernel_and_logs_once(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(dispatch, "_triton_kernel", lambda name: lambda *a, **k: calls.append(name))
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.setenv(BACKEND_ENV, "triton")
    x = torch.randn(2, 8)
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        kernels.gated_rms_norm(x, None, torch.ones(8), group_size=4, eps=1e-6)
        kernels.gated_rms_norm(x, None, torch.ones(8), group_size=4, eps=1e-6)
    assert calls == ["gated_rms_norm", "gated_rms_norm"]
    assert caplog.text.count("kernel backend: triton") == 1


def test_every_dispatched_kernel_has_a_triton_module_and_a_reference():
    for name in TRITON_MODULES:
        assert getattr(kernels, name).__name__ == name
        assert getattr(kernels.reference, f"{name}_ref").__doc__ == getattr(kernels, name).__doc__
