"""Session-wide test setup."""

from __future__ import annotations

import os

import torch

# The session's Ray cluster and service fixtures (tests/service.py), for every test folder
# that needs them (tests/cluster, tests/soak): one cluster per session.
pytest_plugins = ["tests.service"]

# Without a GPU, Triton kernels run under the interpreter (numpy, slow: tests use tiny shapes).
# It must be set before triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
