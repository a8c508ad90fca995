"""Building the CPU kernels: the C and C++ sources under csrc/, compiled at first use, cached
on disk and loaded.

Plain C with no torch headers compiles in a fraction of a second (`-O3 -march=native
-fopenmp`: the loops vectorise, and OpenMP shares the libgomp torch has loaded, so the kernels
run on torch's threads); each .c file is one library, called through ctypes by the module
beside this one that binds it. The C++ of the torch operators (csrc/ops.cpp) is built against
this process's torch (~10 s the first time on a machine) and loaded into its dispatcher.

A library is cached under ~/.cache/hybridserve/kernels/ by a hash of its source file and the
headers it includes, the compiler, the flags and the CPU (a -march=native build runs on its
own CPU only); processes building at once agree through an atomic rename. Without a compiler
(`CC` / `CXX`, else `cc` / `c++`), or when the build fails, `load` returns None (logged) and
the callers run torch instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CACHE_DIR = Path(os.environ.get("HYBRIDSERVE_CACHE", Path.home() / ".cache" / "hybridserve"))
# NOTE: -Wno-psabi: the vector types of attend.h and dot.h are returned by value from static
# inline functions, which GCC notes as an ABI change on CPUs without AVX-512; no call crosses
# a library's boundary with them.
C_FLAGS = ("-O3", "-march=native", "-fopenmp", "-Wno-psabi", "-shared", "-fPIC")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_files(source: Path) -> list[Path]:
    """`source` and every header it includes with `#include "..."`, transitively, each once."""
    found: list[Path] = []
    pending = [source]
    while pending:
        path = pending.pop()
        if path in found:
            continue
        found.append(path)
        pending += [path.parent / name for name in _INCLUDE.findall(path.read_text())]
    return found


def _resolve(source: str | Path) -> Path:
    """A file name under csrc/, or a path (a test's probe)."""
    return source if isinstance(source, Path) else CSRC / source


@functools.cache
def load(source: str | Path) -> ctypes.CDLL | None:
    """The library built from C `source` (a file under csrc/), or None."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    path = _built(_resolve(source), compiler, [*C_FLAGS, "-lm"])
    return None if path is None else ctypes.CDLL(str(path))


@functools.cache
def load_torch_operators(source: str | Path) -> bool:
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
    # The torch version in the key, so the cache changes with it (the C++ ABI does).
    path = _built(_resolve(source), compiler, flags, extra_key=torch.__version__)
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        logger.warning("%s: loading the operators failed, torch runs instead (%s)", source, error)
        return False
    return True


def _built(
    source: Path, compiler: str | None, flags: list[str], extra_key: str = ""
) -> Path | None:
    """The shared library compiled from `source` with `flags` (cached by a hash of it, its
    headers, the compiler and the CPU), or None (logged) without a compiler or when the build
    fails."""
    name = source.stem
    if compiler is None:
        logger.info("%s: no compiler; torch runs instead", name)
        return None
    texts = [f"{path.name}\n{path.read_text()}" for path in source_files(source)]
    key = "\n".join([*texts, compiler, *flags, platform.machine(), _cpu_flags(), extra_key])
    path = CACHE_DIR / "kernels" / f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                command = [compiler, str(source), f"-I{source.parent}", "-o", str(built), *flags]
                subprocess.run(command, check=True, capture_output=True, text=True)
                os.replace(built, path)
        return path
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("%s: the build failed, torch runs instead (%s)", name, detail)
        return None


# (source, symbol) -> the loaded function, or None where the library is not available.
_functions: dict[tuple[str, str], ctypes._CFuncPtr | None] = {}


def function(
    source: str | Path, symbol: str, argtypes: list[type], restype: type | None = None
) -> ctypes._CFuncPtr | None:
    """`symbol` of the library built from `source` (`load`), taking `argtypes` and returning
    `restype` (None: void); None without the library. Looked up once per process."""
    key = (str(source), symbol)
    if key not in _functions:
        library = load(source)
        found = None
        if library is not None:
            found = getattr(library, symbol)
            found.restype = restype
            found.argtypes = argtypes
        _functions[key] = found
    return _functions[key]


def loaded(source: str, symbol: str) -> bool:
    """Whether `function` has loaded `symbol` of `source` (never builds: the compiled decode
    step's tracer asks this)."""
    return _functions.get((source, symbol)) is not None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""
