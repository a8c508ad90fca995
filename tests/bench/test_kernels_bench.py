"""Without a GPU the kernel benchmark says so and exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the no-GPU path")
def test_without_a_gpu_it_exits_cleanly():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kernels.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0
    assert "no CUDA device" in done.stdout
