"""The C kernels' build and threads (kernels/c_library.py)."""

from __future__ import annotations

import ctypes

import pytest

from hybridserve.kernels import c_library
from tests.helpers import on_new_thread_with_torch_threads

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
    sizes: list[int | None] = []

    def stepping_thread() -> None:
        runtime.omp_set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a new thread
        size = ctypes.c_int(0)
        team_size(ctypes.byref(size))
        sizes.append(size.value)
        sizes.append(c_library.follow_torch_threads())
        team_size(ctypes.byref(size))
        sizes.append(size.value)

    on_new_thread_with_torch_threads(stepping_thread)
    assert sizes == [1, 2, 2]
