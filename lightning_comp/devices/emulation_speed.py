"""How much slower than FP32 a 16-bit precision computes on a device where it is emulated, measured once.

Where no 16-bit precision is native (an AVX2-only CPU, a CUDA GPU before sm70 for FP16), the search keeps compute in
FP32: it trains without searching, or searches the memory dimensions alone for an objective that weighs memory. Its
report says why in the device's own terms, with the slowdown measured there: the median of
three timed 256x256 matrix products in each precision, after one untimed one (tens of milliseconds in all, cached per
process and device). The figure is a statement about the device, not a timing the search decides anything by.
"""

from __future__ import annotations

import functools
import time

import torch

from lightning_comp.devices.device_classes import DeviceClass
from lightning_comp.numerics.precision import ComputePrecision

__all__ = ["matmul_slowdown", "why_compute_stays_fp32", "why_nothing_pays"]

_SIZE = 256


@functools.cache
def matmul_slowdown(device: str, precision: ComputePrecision) -> float:
    """Time of a 256x256 matrix product in ``precision`` over FP32's on ``device`` (e.g. ``52.0``: 52x slower)."""
    generator = torch.Generator(device="cpu").manual_seed(0)  # the global RNG is left alone
    a32 = torch.randn(_SIZE, _SIZE, generator=generator).to(device)
    b32 = torch.randn(_SIZE, _SIZE, generator=generator).to(device)
    a, b = a32.to(precision.dtype), b32.to(precision.dtype)

    def timed(x: torch.Tensor, y: torch.Tensor) -> float:
        times = []
        for _ in range(4):
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            start = time.perf_counter()
            torch.mm(x, y)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[1]  # the median of the three after the first

    return timed(a, b) / max(timed(a32, b32), 1e-9)


def why_nothing_pays(device_class: DeviceClass, device: torch.device | str) -> str:
    """Why the search trains in FP32 without searching on ``device``, in its terms, e.g. ``"bf16 is emulated on this
    AVX2 CPU (AMD EPYC, no AVX512-BF16 or AMX): a matrix product runs 52x slower than in fp32 here, ..."``."""
    return _why_no_16_bit(device_class, device, "it trains in fp32 and searches nothing")


def why_compute_stays_fp32(device_class: DeviceClass, device: torch.device | str) -> str:
    """Why a search that weighs memory keeps every operator's compute in FP32 on ``device`` and searches only the
    memory dimensions, in the device's terms (as :func:`why_nothing_pays`)."""
    return _why_no_16_bit(device_class, device, "compute stays fp32 and only the memory dimensions are searched"
                                                " (saved for backward, optimizer state)")


def _why_no_16_bit(device_class: DeviceClass, device: torch.device | str, consequence: str) -> str:
    device = torch.device(device)
    emulated = sorted((p for p in device_class.emulated if not p.is_fp8), key=lambda p: p.value)  # (16-bit ones)
    if device_class.type == "cpu":
        where = (f"this {device_class.capability or 'CPU'} CPU ({device_class.name or 'unknown model'}, no"
                 " AVX512-BF16 or AMX)")
    else:
        where = device_class.describe()
    if not emulated:
        return f"no 16-bit precision runs on {where}; {consequence}"
    parts = [f"{p.value} is emulated on {where}: a matrix product runs {matmul_slowdown(str(device), p):.0f}x"
             f" slower than in fp32 here" for p in emulated[:1]]
    parts += [f"{p.value} {matmul_slowdown(str(device), p):.0f}x" for p in emulated[1:]]
    return "; ".join(parts) + f". No 16-bit precision pays, so {consequence}"
