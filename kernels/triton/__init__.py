"""Triton kernels with the same signatures as `hybridserve.kernels.reference`.

They run on CUDA tensors, or on the CPU under `TRITON_INTERPRET=1` (tests). Import this package
only through `hybridserve.kernels`, which picks the backend per call.
"""
