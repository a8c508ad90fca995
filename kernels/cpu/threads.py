"""An engine's OpenMP team: its thread count, and its cores (csrc/threads.c).

Torch's operators and our C kernels share one OpenMP runtime (the libgomp torch loads),
which keeps a team of threads per thread that opens a parallel region; docs/architecture.md
says why an engine keeps to one team on the thread that steps it.
"""

from __future__ import annotations

import ctypes
import functools

from hybridserve.kernels.cpu import library


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime our kernels link: the libgomp torch has loaded (same soname), or
    None where there is none."""
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


def follow_torch_threads() -> int | None:
    """Give this thread's OpenMP parallel regions torch's thread count, and return it.

    OpenMP keeps a thread count per thread: a new thread starts from OMP_NUM_THREADS (Ray
    sets it to an actor's CPUs, 1 by default), and `torch.set_num_threads` changes only the
    calling thread's. Torch's own regions name torch's count; our kernels' plain `omp
    parallel` regions take the thread's. An engine stepped on a thread of its own in a Ray
    actor with `torch_threads=2` therefore ran its GEMMs on two threads and every C kernel
    (the native decode step included) on one. The thread that steps an engine calls this
    first. None without an OpenMP runtime (the kernels then run on one thread anyway)."""
    import torch

    runtime = _openmp()
    if runtime is None:
        return None
    runtime.omp_set_num_threads(torch.get_num_threads())
    return runtime.omp_get_max_threads()


def bind_team(cores: list[int]) -> bool:
    """Confine the calling thread and its OpenMP team (the threads that run its parallel
    regions, torch's and our kernels') to `cores`; threads the team starts later inherit the
    mask from the calling thread. Other threads of the process stay where they are. Call it
    on the thread that steps the engine, after `follow_torch_threads` (the region must be as
    large as the team). False where it could not (no compiler, a core outside the process's
    affinity)."""
    bind = library.function(
        "threads.c", "bind_team", [ctypes.c_void_p, ctypes.c_int64], restype=ctypes.c_int
    )
    if bind is None or not cores:
        return False
    return bind((ctypes.c_int64 * len(cores))(*cores), len(cores)) == 0
