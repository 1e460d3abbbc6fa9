"""Builds a C source of the package into a shared library for this CPU, once, and loads it with :mod:`ctypes`.

The native update (:mod:`lightning_comp.execution.native_adam`) is C compiled on the machine that runs it, with the
machine's own instruction set (``-march=native``), as ``torch.compile`` compiles its CPU kernels: it needs a C
compiler (``$CC``, a command with arguments if need be, such as ``ccache gcc``; else ``cc``, ``gcc`` or ``clang``
on the ``PATH``), as Inductor does. A build takes well under a
second and is kept in a cache directory (``$LIGHTNING_COMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_comp``, else
``~/.cache/lightning_comp``) under a name hashed from the source, the compiler and its version, the flags and the CPU
(:func:`~lightning_comp.devices.cpu_features.cpu_identity`), so a later process loads it without compiling, a changed
source or compiler builds anew, and machines sharing a home directory never load code built for another CPU. Processes
building at once (the ranks of a DDP job) each write a file of their own and rename it into place.

Flags are tried in order: with OpenMP (the kernel shares its blocks among threads), then without (one thread; Apple's
clang has no ``-fopenmp``), then without ``-march=native``. Where every attempt fails, :class:`NativeBuildError`
names the compiler's first error line.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lightning_comp.devices.cpu_features import cpu_identity
from lightning_comp.errors import NativeBuildError

__all__ = ["NativeLibrary", "cache_dir", "load_library"]

_BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
_ATTEMPTS = (("-march=native", "-fopenmp"), ("-march=native",), ())
_COMPILE_TIMEOUT_S = 300


@dataclass(frozen=True)
class NativeLibrary:
    """A loaded build: the library, the file it came from, whether it runs its loops on several threads, and
    whether it was built for this CPU's own instruction set (``-march=native``)."""

    library: ctypes.CDLL
    path: Path
    threaded: bool
    native_isa: bool


def cache_dir() -> Path:
    """Where builds are kept (see the module docstring)."""
    explicit = os.environ.get("LIGHTNING_COMP_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "lightning_comp"


def _compiler() -> tuple[str, ...]:
    """The C compiler's command: ``$CC`` if set (split as a shell would, so ``CC="ccache gcc"`` works; its first word
    must exist), else the first of cc, gcc, clang on the PATH."""
    explicit = os.environ.get("CC", "").strip()
    if explicit:
        try:
            words = shlex.split(explicit)
        except ValueError as error:
            raise NativeBuildError(f"CC={explicit!r} cannot be split into a command ({error}); set CC to a C compiler"
                                   " (gcc or clang), optionally with arguments.") from error
        found = shutil.which(words[0])
        if found is None:
            raise NativeBuildError(f"CC={explicit!r} names no executable ({words[0]!r} is not on the PATH); set CC to"
                                   " a C compiler (gcc or clang).")
        return (found, *words[1:])
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found is not None:
            return (found,)
    raise NativeBuildError("No C compiler found (tried $CC, cc, gcc, clang on the PATH); install gcc or clang, or"
                           " set CC.")


@functools.cache
def _compiler_version(compiler: tuple[str, ...]) -> str:
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeBuildError(f"The C compiler {shlex.join(compiler)!r} could not be run ({error}).") from error
    return done.stdout.strip()


def _target(source: Path, compiler: tuple[str, ...], flags: tuple[str, ...]) -> Path:
    digest = hashlib.sha256()
    for part in (source.read_bytes(), shlex.join(compiler).encode(), _compiler_version(compiler).encode(),
                 " ".join(flags).encode(), cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / "kernels" / f"{source.stem}-{digest.hexdigest()[:24]}.so"


def _compile(source: Path, compiler: tuple[str, ...], flags: tuple[str, ...], target: Path) -> str | None:
    """Compile ``source`` into ``target`` (atomically); None on success, else the compiler's first error line (or
    why the cache directory cannot take the file)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=target.stem, suffix=".so.partial", dir=target.parent)
        os.close(handle)
    except OSError as error:
        return f"cache directory {target.parent} not writable ({error}); set LIGHTNING_COMP_CACHE_DIR"
    try:
        done = subprocess.run([*compiler, *flags, str(source), "-o", partial], capture_output=True, text=True,
                              timeout=_COMPILE_TIMEOUT_S, check=False)
        if done.returncode != 0:
            lines = [line for line in (done.stderr or done.stdout).splitlines() if "error" in line.lower()]
            return (lines or (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"])[0]
        os.replace(partial, target)
        return None
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _cached(target: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """The library in ``target``, or None and why it does not load."""
    try:
        return ctypes.CDLL(str(target)), None
    except OSError as error:
        return None, f"cannot load {target}: {error}"


@functools.cache
def load_library(source: Path) -> NativeLibrary:
    """``source`` built for this CPU (from the cache, or compiled now) and loaded; once per process and source.

    Raises:
        NativeBuildError: if no compiler is found, or no attempt builds and loads (the message names the first
            attempt's error).
    """
    compiler = _compiler()
    failures: list[str] = []
    for extra in _ATTEMPTS:
        flags = (*_BASE_FLAGS, *extra)
        target = _target(source, compiler, flags)
        library, error = _cached(target) if target.exists() else (None, None)
        if library is None:  # not built yet, or a cached file that does not load (a truncated write): build it
            error = _compile(source, compiler, flags, target)
            library, load_error = (None, None) if error is not None else _cached(target)
            error = error or load_error
        if library is None:
            failures.append(f"{' '.join(extra) or 'plain'}: {error}")
            continue
        return NativeLibrary(library, target, threaded="-fopenmp" in extra, native_isa="-march=native" in extra)
    raise NativeBuildError(f"{source.name} could not be built with {shlex.join(compiler)} ({failures[0]}; "
                           f"{len(failures)} attempts failed).")
