"""The C kernels' build (kernels/cpu/library.py) and their threads (kernels/cpu/threads.py)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from hybridserve.kernels.cpu import library, threads
from tests.helpers import on_new_thread_with_torch_threads

TEAM_SIZE = Path(__file__).with_name("team_size.c")  # a probe kernel


def test_a_thread_s_kernels_follow_torch_s_thread_count():
    """A thread starts from OMP_NUM_THREADS (Ray sets it to 1 in an actor), which the C
    kernels' parallel regions would take; after `follow_torch_threads` they take torch's."""
    team_size = library.function(TEAM_SIZE, "team_size", [ctypes.c_void_p])
    runtime = threads._openmp()
    # CI has a C compiler, and torch's Linux wheels load libgomp: neither may be missing.
    assert team_size is not None and runtime is not None
    sizes: list[int | None] = []

    def stepping_thread() -> None:
        runtime.omp_set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a new thread
        size = ctypes.c_int(0)
        team_size(ctypes.byref(size))
        sizes.append(size.value)
        sizes.append(threads.follow_torch_threads())
        team_size(ctypes.byref(size))
        sizes.append(size.value)

    on_new_thread_with_torch_threads(stepping_thread)
    assert sizes == [1, 2, 2]


@pytest.mark.parametrize("source", sorted(p.name for p in library.CSRC.glob("*.c*")))
def test_each_source_compiles_without_a_warning(source):
    """Every C and C++ source under csrc/, with the flags the build uses plus -Wall -Werror
    (the C++ against this torch's headers, which are system headers there)."""
    path = library.CSRC / source
    if path.suffix == ".c":
        compiler, flags = shutil.which("cc") or shutil.which("gcc"), list(library.C_FLAGS)
    else:
        from torch.utils import cpp_extension

        compiler, flags = shutil.which("c++") or shutil.which("g++"), ["-std=c++20"]
        for folder in cpp_extension.include_paths():
            flags += ["-isystem", folder]
    assert compiler is not None, "CI has a C and a C++ compiler (the kernels build with them)"
    flags = [f for f in flags if f not in ("-shared", "-fPIC")]
    command = [compiler, "-fsyntax-only", "-Wall", "-Werror", f"-I{library.CSRC}", *flags]
    result = subprocess.run([*command, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_source_s_cache_key_covers_the_headers_it_includes():
    """decode_step.c includes five headers (fp8.h through dot.h too); a change in any of them
    must rebuild it."""
    names = {path.name for path in library.source_files(library.CSRC / "decode_step.c")}
    assert names == {
        "decode_step.c",
        "attend.h",
        "dot.h",
        "fp8.h",
        "gated_delta_head.h",
        "ssm_update_head.h",
    }
