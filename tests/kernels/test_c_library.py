"""The C kernels' build and threads (kernels/c_library.py)."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from hybridserve.kernels import c_library

TEAM_SOURCE = """
#include <omp.h>
void team_size(int *size) {
#pragma omp parallel
  {
#pragma omp single
    *size = omp_get_num_threads();
  }
}
"""


def test_a_thread_s_kernels_follow_torch_s_thread_count():
    """A thread starts from OMP_NUM_THREADS (Ray sets it to 1 in an actor), which the C
    kernels' parallel regions would take; after `follow_torch_threads` they take torch's."""
    team_size = c_library.function("team_size", TEAM_SOURCE, "team_size", [ctypes.c_void_p])
    runtime = c_library._openmp()
    if team_size is None or runtime is None:
        pytest.skip("no C compiler or no OpenMP runtime")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    sizes: list[int | None] = []

    def stepping_thread() -> None:
        runtime.omp_set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a new thread
        size = ctypes.c_int(0)
        team_size(ctypes.byref(size))
        sizes.append(size.value)
        sizes.append(c_library.follow_torch_threads())
        team_size(ctypes.byref(size))
        sizes.append(size.value)

    try:
        thread = threading.Thread(target=stepping_thread)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert sizes == [1, 2, 2]
