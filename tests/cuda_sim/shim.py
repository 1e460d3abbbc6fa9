"""Build the simulated-CUDA shim for the installed torch, and load it before torch (nothing here imports torch).

The shim is compiled once per torch version and shim source (about 5 s with g++) into ``tests/cuda_sim/.build/``.
:func:`build_shim` returns the library's path, or raises :class:`ShimUnavailable` saying why it cannot exist here:
no C++ compiler, a torch that is not a CPU build (the shim would shadow a real CUDA build's hooks: run the checks on
the real device instead), or a failed compilation (its output kept in the message).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["SOURCE", "ShimUnavailable", "build_shim", "load_shim"]

SOURCE = Path(__file__).with_name("shim.cpp")
BUILD_DIR = Path(__file__).with_name(".build")
_LOADED_SYMBOL = "lightning_comp_cuda_sim_loaded"


class ShimUnavailable(RuntimeError):
    """The shim cannot be built or loaded here (the message says why)."""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise ShimUnavailable("torch is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def torch_version() -> str:
    """The installed torch's version string (``2.13.0+cpu``), read without importing torch."""
    return importlib.metadata.version("torch")


def _compiler() -> str:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise ShimUnavailable("no C++ compiler (g++, c++ or clang++; or $CXX) on PATH to build the simulated-CUDA shim")


def build_shim(build_dir: Path = BUILD_DIR) -> Path:
    """The shim library for the installed torch, compiled now if not yet (cached by torch version and source).

    Raises:
        ShimUnavailable: if it cannot be built here (no compiler, not a CPU build of torch, a compile error).
    """
    version = torch_version()
    if "+cpu" not in version:
        raise ShimUnavailable(f"torch {version} is not a CPU-only build: the shim would shadow its CUDA hooks (on a"
                              " machine with a GPU run `python -m tests.cuda_sim.run --real`)")
    torch_dir = _torch_dir()
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode() + str(torch_dir).encode()).hexdigest()[:12]
    library = build_dir / f"cuda_sim_{digest}.so"
    if library.exists():
        return library
    compiler = _compiler()
    build_dir.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    command = [compiler, "-std=c++20", "-shared", "-fPIC", "-O1", "-w", f"-I{torch_dir / 'include'}",
               f"-L{torch_dir / 'lib'}", f"-Wl,-rpath,{torch_dir / 'lib'}", str(SOURCE), "-lc10", "-ltorch_cpu",
               "-o", str(partial)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise ShimUnavailable(f"compiling the shim failed ({' '.join(command)}):\n{done.stderr[-4000:]}")
    partial.replace(library)  # atomic: a concurrent build never loads a half-written library
    return library


def load_shim(library: Path) -> None:
    """Load ``library`` into this process; torch must not be imported yet.

    Raises:
        ShimUnavailable: if torch is already imported (the shim would have no effect) or the library does not load.
    """
    if "torch" in sys.modules:
        raise ShimUnavailable("torch was imported before the shim: load it first (python -m tests.cuda_sim.run)")
    try:
        handle = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise ShimUnavailable(f"the shim {library} does not load: {err}") from None
    if getattr(handle, _LOADED_SYMBOL)() != 1:  # pragma: no cover - the symbol returns 1
        raise ShimUnavailable(f"{library} is not the simulated-CUDA shim")
