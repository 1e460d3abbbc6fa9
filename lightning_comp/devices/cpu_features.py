"""What this CPU can do: its vector ISA, its native 16-bit features, its name.

Public APIs are used where torch has them: ``torch.backends.cpu.get_cpu_capability()`` names the vector ISA that
ATen's kernels dispatch to (``"AVX2"``, ``"AVX512"``, ``"DEFAULT"``...; it honours ``ATEN_CPU_CAPABILITY``). Whether
the CPU has native BF16/FP16 arithmetic (AVX512-BF16, AMX tiles, AMX-FP16) has no public API: torch's private
``torch.cpu._is_*_supported`` probes (cpuinfo) are read through :mod:`lightning_comp.adapters.torch_internals`, and
``/proc/cpuinfo`` flags replace any probe that a future torch no longer has.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

from lightning_comp.adapters.torch_internals import cpu_feature_probe

__all__ = ["cpu_capability", "cpu_features", "cpu_identity", "cpu_name", "FEATURES"]

# feature -> the /proc/cpuinfo flags that imply it (torch's own probe of the feature is tried first)
_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2",),
    "avx512": ("avx512f",),
    "avx512_bf16": ("avx512_bf16",),
    "amx_tile": ("amx_tile",),
    "amx_fp16": ("amx_fp16",),
}
FEATURES: tuple[str, ...] = tuple(_FLAGS)


def cpu_capability() -> str:
    """The vector ISA ATen dispatches CPU kernels to (public ``torch.backends.cpu.get_cpu_capability()``)."""
    getter = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    if getter is None:
        return "DEFAULT"
    try:
        return str(getter())
    except RuntimeError:  # pragma: no cover - a torch built without the CPU capability query
        return "DEFAULT"


@functools.cache
def _proc_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_features() -> frozenset[str]:
    """The features of :data:`FEATURES` this CPU has: torch's probes, or ``/proc/cpuinfo`` where a probe is gone.

    These describe the silicon, not what ATen dispatches to: under ``ATEN_CPU_CAPABILITY=avx2`` an AVX512-BF16 CPU
    still lists ``avx512_bf16`` here (see :func:`cpu_capability` for the dispatch level).
    """
    found = set()
    for feature, flags in _FLAGS.items():
        probe = cpu_feature_probe(feature)
        try:
            present = bool(probe()) if probe is not None else bool(_proc_flags().intersection(flags))
        except Exception:  # a probe that breaks must not break training: fall back to the kernel's flags
            present = bool(_proc_flags().intersection(flags))
        if present:
            found.add(feature)
    return frozenset(found)


@functools.cache
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what :func:`platform.processor` says, or ``"cpu"``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def cpu_identity() -> str:
    """What code built for this CPU (``-march=native``) depends on: its architecture, model name and every
    ``/proc/cpuinfo`` flag, so that machines sharing a build cache never load each other's instructions."""
    return " ".join([platform.machine(), cpu_name(), *sorted(_proc_flags())])
