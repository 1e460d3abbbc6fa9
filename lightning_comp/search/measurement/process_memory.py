"""The peak the process needs for one training step (what decides whether a job fits).

CUDA: the caching allocator's allocated and reserved peaks side by side. CPU: the live peak (glibc
``mallinfo2`` in-use bytes, sampled after every dispatched operator of the step) and the OS-level peak
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``; the largest sampled RSS where the reset is
not allowed). The allocator's addition is ``os_bytes - live_bytes``. Anything missing degrades to ``None``
with the reason in ``how``; nothing here raises on an unsupported platform.

The step's *tensor* peak (:attr:`StepPeak.tensor_bytes`, what a budget as a fraction of AMP's step peak is judged
by) is CUDA's allocated peak; on a CPU, the tensors held on entering the step (:func:`held_tensor_bytes`: weights,
gradients, optimizer state) plus the live heap's rise over the step, so the interpreter's own heap, the same for
every plan, does not dilute the fraction.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PROC_STATUS = "/proc/self/status"
PROC_CLEAR_REFS = "/proc/self/clear_refs"


@dataclass(frozen=True)
class StepPeak:
    """The peak one step needed.

    Attributes:
        live_bytes: bytes live at the step's high point (CPU heap in use; ``None`` when not measurable).
        os_bytes: the OS-level peak of the process (``VmHWM`` or sampled RSS; ``None`` when not measurable).
        reserved_bytes: the CUDA allocator's reserved peak (``None`` off CUDA).
        allocated_bytes: the CUDA allocator's allocated peak (``None`` off CUDA).
        how: how each figure was measured, or why it is missing.
    """

    live_bytes: int | None
    os_bytes: int | None
    reserved_bytes: int | None
    allocated_bytes: int | None
    how: str
    rise_bytes: int | None = None
    held_bytes: int | None = None

    @property
    def tensor_bytes(self) -> int | None:
        """The step's tensor peak: CUDA's allocated peak; on a CPU the tensors held on entering (``held_bytes``) plus
        the live heap's rise over the step (``rise_bytes``); ``None`` where either is unknown."""
        if self.allocated_bytes is not None:
            return self.allocated_bytes
        if self.held_bytes is None or self.rise_bytes is None:
            return None
        return self.held_bytes + self.rise_bytes

    @property
    def allocator_bytes(self) -> int | None:
        """What the allocator adds over the live peak (``os_bytes - live_bytes``), when both are known."""
        if self.live_bytes is None or self.os_bytes is None:
            return None
        return self.os_bytes - self.live_bytes


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _libc() -> Any | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def heap_in_use() -> int | None:
    """Bytes the C heap has handed out and not taken back (glibc ``mallinfo2``), or ``None`` without glibc."""
    if _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _status_bytes(field: str) -> int | None:
    try:
        with open(PROC_STATUS) as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open(PROC_CLEAR_REFS, "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


class _LiveSampler(TorchDispatchMode):
    """Samples the heap in use and the RSS after every operator the step dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.live = heap_in_use() or 0
        self.entry = self.live  # what was live on entering
        self.rss = _status_bytes("VmRSS") or 0

    def sample(self) -> None:
        live = heap_in_use()
        if live is not None and live > self.live:
            self.live = live
        rss = _status_bytes("VmRSS") if self.sample_rss else None
        if rss is not None and rss > self.rss:
            self.rss = rss

    sample_rss = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


def measure_step_peak(step: Callable[[], Any], device: torch.device | str | None = None) -> StepPeak:
    """Runs ``step`` once and returns the peak the process needed for it.

    Args:
        step: one training step (forward, backward, optimizer step).
        device: where the step runs; a CUDA device also reads the caching allocator's peaks.

    Returns:
        The step's :class:`StepPeak`; figures that cannot be measured here are ``None``, with the reason in ``how``.
    """
    with StepPeakRecorder(device) as recorder:
        step()
    assert recorder.peak is not None
    return recorder.peak


class StepPeakRecorder:
    """The peak the process needs between entering and leaving it, for a step that is not one callable (a
    training loop's hooks: enter at the batch's start, leave at its end)::

        with StepPeakRecorder(device) as recorder:
            ...  # forward, backward, optimizer step
        recorder.peak  # a StepPeak

    Args:
        device: where the step runs; a CUDA device also reads the caching allocator's peaks.
        reset_hwm: take the OS-level peak as ``VmHWM`` after resetting it (``clear_refs``) on entering, so nothing
            else may rely on ``VmHWM`` across the step; ``False``: the largest ``VmRSS`` sampled per operator, which
            leaves ``VmHWM`` alone (and may miss a peak between two operators).
    """

    def __init__(self, device: torch.device | str | None = None, *, reset_hwm: bool = True) -> None:
        self.device = device
        self.reset_hwm = reset_hwm
        self.peak: StepPeak | None = None
        self._cuda = device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()
        self._reset = False
        self._allocated_on_entry = 0
        self._sampler = _LiveSampler()

    def __enter__(self) -> StepPeakRecorder:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._allocated_on_entry = int(torch.cuda.memory_allocated(self.device))
        self._reset = self.reset_hwm and _reset_hwm()
        self._sampler = _LiveSampler()
        self._sampler.sample_rss = not self._reset
        self._sampler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        sampler = self._sampler
        sampler.__exit__(*exc)
        sampler.sample()
        notes: list[str] = []
        if self._cuda:
            torch.cuda.synchronize(self.device)
        live: int | None = sampler.live if heap_in_use() is not None else None
        notes.append("live: glibc mallinfo2 in use, sampled per operator" if live is not None
                     else "live: unavailable (no glibc mallinfo2)")
        os_peak: int | None
        if self._reset:
            os_peak = _status_bytes("VmHWM")
            notes.append("os: VmHWM after clear_refs reset")
        elif sampler.rss:
            os_peak = sampler.rss
            notes.append("os: sampled VmRSS per operator"
                         + ("" if not self.reset_hwm else f" ({PROC_CLEAR_REFS} not writable)"))
        else:
            os_peak = None
            notes.append(f"os: unavailable (no {PROC_STATUS})")
        allocated = reserved = None
        rise = None if live is None else live - sampler.entry
        if self._cuda:
            allocated = int(torch.cuda.max_memory_allocated(self.device))
            reserved = int(torch.cuda.max_memory_reserved(self.device))
            rise = allocated - self._allocated_on_entry
            notes.append("cuda: max_memory_allocated / max_memory_reserved")
        self.peak = StepPeak(live, os_peak, reserved, allocated, "; ".join(notes), rise_bytes=rise)


def held_tensor_bytes(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of the tensors a step starts with: ``module``'s parameters, their gradients and every tensor in the
    optimizers' state, each storage counted once."""
    seen: set[tuple[str, int]] = set()
    total = 0

    def add(tensor: object) -> None:
        nonlocal total
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            return
        seen.add(key)
        total += storage.nbytes()

    for parameter in module.parameters():
        add(parameter)
        add(parameter.grad)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
    return total


def set_malloc_thresholds(trim_bytes: int = 128 * 1024, mmap_bytes: int = 128 * 1024) -> bool:
    """Fixes glibc's trim and mmap thresholds (``mallopt``), so freed large blocks go back to the OS at once.

    glibc raises its mmap threshold dynamically after large frees, which lets a step's many transient
    allocations stay in the heap and the OS peak grow above the live peak. Fixing both thresholds stops
    that. Not applied by the package; call it before training if the OS peak is what must fit.

    Args:
        trim_bytes: ``M_TRIM_THRESHOLD``.
        mmap_bytes: ``M_MMAP_THRESHOLD``.

    Returns:
        Whether glibc accepted both settings (``False`` without glibc).
    """
    if _LIBC is None or os.name != "posix":
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(_LIBC.mallopt(m_trim_threshold, trim_bytes)) and bool(_LIBC.mallopt(m_mmap_threshold, mmap_bytes))
