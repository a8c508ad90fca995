"""The dispatch table and the backend choice: Triton for CUDA tensors, the CPU kernel or the
reference on the CPU, or forced by env."""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

import pytest
import torch

from hybridserve import kernels
from hybridserve.kernels import dispatch
from hybridserve.kernels.cpu import library
from hybridserve.kernels.dispatch import BACKEND_ENV, KERNELS, implementation, kernel_backend


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

    def fake(name, backend):
        return (lambda *a, **k: calls.append(name)) if backend == "triton" else None

    monkeypatch.setattr(dispatch, "implementation", fake)
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.setenv(BACKEND_ENV, "triton")
    x = torch.randn(2, 8)
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        kernels.gated_rms_norm(x, None, torch.ones(8), group_size=4, eps=1e-6)
        kernels.gated_rms_norm(x, None, torch.ones(8), group_size=4, eps=1e-6)
    assert calls == ["gated_rms_norm", "gated_rms_norm"]
    assert caplog.text.count("kernel backend: triton") == 1


def test_every_kernel_of_the_table_exists_and_each_dispatched_one_is_exported():
    for name, kernel in KERNELS.items():
        for backend in ("reference", "triton", "cpu"):
            if getattr(kernel, backend) is not None:
                assert callable(implementation(name, backend)), (name, backend)
        if kernel.reference is not None and kernel.reference.startswith("reference."):
            exported = getattr(kernels, name)
            assert exported.__name__ == name
            assert exported.__doc__ == implementation(name, "reference").__doc__


def test_the_table_reaches_every_cpu_kernel():
    """Each C or C++ source under kernels/cpu/csrc/ is bound by the module of its name
    (cpu/<source>.py), that module binds every function the source exports (or registers,
    for the C++ operators), and the table names the module: no CPU kernel is called around
    dispatch. threads.c is the OpenMP team's binding, not a kernel."""
    bound = {where.split(":")[0] for k in KERNELS.values() if (where := k.cpu) is not None}
    sources = sorted(library.CSRC.glob("*.c")) + sorted(library.CSRC.glob("*.cpp"))
    assert len(sources) == 9
    for source in sources:
        if source.name == "threads.c":
            continue
        module = f"cpu.{source.stem}"
        assert module in bound, f"{source.name}: no kernel of the dispatch table uses it"
        text = source.read_text()
        if source.suffix == ".c":
            exported = re.findall(r"^(?:void|int|float|int64_t) \**(\w+)\(", text, re.MULTILINE)
        else:
            exported = re.findall(r'm\.(?:impl|def)\("(\w+)', text)
        binding = importlib.import_module(f"hybridserve.kernels.{module}")
        binding_text = Path(binding.__file__).read_text()
        assert exported, source.name
        for symbol in exported:
            assert symbol in binding_text, f"{source.name}: {symbol} is not bound"
