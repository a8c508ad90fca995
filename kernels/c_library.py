"""Small C kernels for the CPU: compiled at first use, cached on disk, called through ctypes;
and the C++ that registers them as torch operators (`load_torch_operators`).

Plain C with no torch headers compiles in a fraction of a second (`-O3 -march=native
-fopenmp`: the loops vectorise, and OpenMP shares the libgomp torch has loaded, so the kernels
run on torch's threads). Each library is cached under ~/.cache/hybridserve/kernels/ by a hash of
its source, the compiler, the flags and the CPU (a -march=native build runs on its own CPU
only); processes building at once agree through an atomic rename. Without a C compiler (`CC`,
else `cc`), or when the build fails, `load` returns None and the caller runs torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_DIR = Path(os.environ.get("HYBRIDSERVE_CACHE", Path.home() / ".cache" / "hybridserve"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


@functools.cache
def load(name: str, source: str) -> ctypes.CDLL | None:
    """The library built from `source` (logged as `name`), or None."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    path = _built(name, source, ".c", compiler, [*FLAGS, "-lm"])
    return None if path is None else ctypes.CDLL(str(path))


@functools.cache
def load_torch_operators(name: str, source: str) -> bool:
    """Build C++ `source` against this torch (`TORCH_LIBRARY_IMPL` registrations: torch
    headers make this a ~10 s build, cached like the C libraries) and load it into the
    dispatcher; whether that worked."""
    import torch
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    for folder in cpp_extension.include_paths():
        flags += ["-isystem", folder]
    for folder in cpp_extension.library_paths():
        flags += [f"-L{folder}", f"-Wl,-rpath,{folder}"]
    flags += ["-lc10", "-ltorch_cpu", "-ltorch"]
    # The torch version in the source, so the cache key changes with it (the C++ ABI does).
    path = _built(name, f"// torch {torch.__version__}\n{source}", ".cpp", compiler, flags)
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        logger.warning("%s: loading the operators failed, torch runs instead (%s)", name, error)
        return False
    return True


def _built(
    name: str, source: str, suffix: str, compiler: str | None, flags: list[str]
) -> Path | None:
    """The shared library compiled from `source` with `flags` (cached by a hash of all of it,
    the compiler and the CPU), or None (logged) without a compiler or when the build fails."""
    if compiler is None:
        logger.info("%s: no compiler; torch runs instead", name)
        return None
    key = " ".join((source, compiler, *flags, platform.machine(), _cpu_flags()))
    path = CACHE_DIR / "kernels" / f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                source_file, built = Path(tmp) / f"{name}{suffix}", Path(tmp) / path.name
                source_file.write_text(source)
                command = [compiler, str(source_file), "-o", str(built), *flags]
                subprocess.run(command, check=True, capture_output=True, text=True)
                os.replace(built, path)
        return path
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("%s: the build failed, torch runs instead (%s)", name, detail)
        return None


# (library name, symbol) -> the loaded function, or None where the library is not available.
_functions: dict[tuple[str, str], ctypes._CFuncPtr | None] = {}


def function(name: str, source: str, symbol: str, argtypes: list[type]) -> ctypes._CFuncPtr | None:
    """`symbol` of the library built from `source` (`load`), returning void and taking
    `argtypes`; None without the library. Looked up once per process."""
    key = (name, symbol)
    if key not in _functions:
        library = load(name, source)
        found = None
        if library is not None:
            found = getattr(library, symbol)
            found.restype = None
            found.argtypes = argtypes
        _functions[key] = found
    return _functions[key]


def loaded(name: str, symbol: str) -> bool:
    """Whether `function` has loaded `symbol` of library `name` (never builds: the compiled
    decode step's tracer asks this)."""
    return _functions.get((name, symbol)) is not None


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


_BIND_TEAM_SOURCE = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>

/* Confine the calling thread and every member of its OpenMP team to the `count` cores: each
   sets its own mask in one parallel region. Returns how many threads could not. */
int bind_team(const int64_t *cores, int64_t count) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int64_t i = 0; i < count; ++i) CPU_SET((int)cores[i], &set);
    int failed = 0;
#pragma omp parallel reduction(+ : failed)
    failed += sched_setaffinity(0, sizeof set, &set) != 0;
    return failed;
}
"""


def bind_team(cores: list[int]) -> bool:
    """Confine the calling thread and its OpenMP team (the threads that run its parallel
    regions, torch's and our kernels') to `cores`; threads the team starts later inherit the
    mask from the calling thread. Other threads of the process stay where they are. Call it
    on the thread that steps the engine, after `follow_torch_threads` (the region must be as
    large as the team). False where it could not (no compiler, a core outside the process's
    affinity)."""
    library = load("bind_team", _BIND_TEAM_SOURCE)
    if library is None or not cores:
        return False
    library.bind_team.restype = ctypes.c_int
    library.bind_team.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    return library.bind_team((ctypes.c_int64 * len(cores))(*cores), len(cores)) == 0


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""
