"""Where a model runs, and which low precisions (16-bit, fp8) that device computes natively: its *device class*.

Everything device-dependent in lightning-comp (autocast device, how each operator is lowered, the loss scaler,
what ``CoMPSearch(low_precision="auto")`` resolves to, timing and memory probes) is decided from the device the
model's parameters are on *when it runs*, never from where it was when Lightning called ``convert_module`` (Lightning
moves the model to its device after that call).

=======================  ==========================  ==========================
device                   native (faster than FP32)   emulated (runs, slower)
=======================  ==========================  ==========================
CPU, AVX2 only           none                        bf16 (30-100x), fp16, fp8
CPU, AVX512-BF16         bf16                        fp16, fp8
CPU, AMX (+AMX-FP16)     bf16 (+fp16)                fp16 without AMX-FP16, fp8
CUDA sm70-sm75           fp16                        bf16 where torch emulates it
CUDA sm80-sm87           fp16, bf16                  none (no fp8 matmul kernel)
CUDA sm89+               fp16, bf16, fp8             none
=======================  ==========================  ==========================

"fp8" stands for both fp8 precisions (``fp8``, ``fp8-rowwise``): float8 matmuls through ``torch._scaled_mm``, which
has CUDA kernels from compute capability 8.9 (L4/L40, H100/H200, B200) and an emulating CPU kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_comp.devices.cpu_features import cpu_capability, cpu_features, cpu_name
from lightning_comp.errors import PlanError
from lightning_comp.numerics.precision import ComputePrecision, parse_precision

__all__ = ["DeviceClass", "device_class", "model_device"]

_LOW = (ComputePrecision.BF16, ComputePrecision.FP16)
_FP8 = (ComputePrecision.FP8, ComputePrecision.FP8_ROWWISE)


@dataclass(frozen=True)
class DeviceClass:
    """The class of a device as far as mixed precision is concerned.

    Attributes:
        type: torch device type (``"cpu"``, ``"cuda"``, ...).
        name: the device's name (``"NVIDIA H200"``, ``"AMD EPYC"``).
        capability: CPU: the ISA ATen dispatches to (``"AVX2"``, ``"AVX512"``); CUDA: ``"sm90"`` etc.
        native: low precisions (16-bit, fp8) with native kernels there (expected faster than FP32).
        emulated: low precisions that run there but are emulated (expected slower than FP32).
        features: CPU features that decided it (``avx512_bf16``, ``amx_tile``, ``amx_fp16``).
    """

    type: str
    name: str = ""
    capability: str = ""
    native: frozenset[ComputePrecision] = field(default_factory=frozenset)
    emulated: frozenset[ComputePrecision] = field(default_factory=frozenset)
    features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "native", frozenset(parse_precision(p) for p in self.native))
        object.__setattr__(self, "emulated", frozenset(parse_precision(p) for p in self.emulated) - self.native)
        object.__setattr__(self, "features", tuple(sorted(str(f) for f in self.features)))

    def is_native(self, precision: object) -> bool:
        """Whether ``precision`` is expected to be faster than FP32 here (FP32 always is 'native')."""
        wanted = parse_precision(precision)
        return wanted is ComputePrecision.FP32 or wanted in self.native

    def runs(self, precision: object) -> bool:
        """Whether ``precision`` computes here at all, natively or emulated."""
        wanted = parse_precision(precision)
        return wanted is ComputePrecision.FP32 or wanted in self.native or wanted in self.emulated

    def describe(self) -> str:
        """One line for messages, e.g. ``"cpu AVX2 (AMD EPYC; no native 16-bit)"``,
        ``"cuda sm90 (NVIDIA H100; bf16/fp16 native 16-bit, fp8 native)"``."""
        native = "/".join(sorted(p.value for p in self.native if not p.is_fp8)) or "no"
        fp8 = ", fp8 native" if any(p.is_fp8 for p in self.native) else ""
        where = "; ".join(part for part in (self.name, f"{native} native 16-bit{fp8}") if part)
        return f"{self.type} {self.capability}".strip() + f" ({where})"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (plans and checkpoints must load with ``weights_only=True``)."""
        return {"type": self.type, "name": self.name, "capability": self.capability,
                "native": sorted(p.value for p in self.native), "emulated": sorted(p.value for p in self.emulated),
                "features": list(self.features)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceClass:
        """Read what :meth:`to_dict` wrote.

        Raises:
            PlanError: if ``data`` is not such a mapping.
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("type"), str):
            raise PlanError(f"Malformed device class {data!r}: expected a mapping with a string 'type'.")
        unknown = set(data) - {"type", "name", "capability", "native", "emulated", "features"}
        if unknown:
            raise PlanError(f"Unknown keys {sorted(unknown)} in a device class {dict(data)!r}.")
        try:
            return cls(type=data["type"], name=str(data.get("name", "")), capability=str(data.get("capability", "")),
                       native=frozenset(data.get("native", ())), emulated=frozenset(data.get("emulated", ())),
                       features=tuple(data.get("features", ())))
        except (PlanError, TypeError) as err:
            raise PlanError(f"Malformed device class {dict(data)!r}: {err}") from None


def model_device(module: nn.Module, default: str = "cpu") -> torch.device:
    """The device of the first parameter (or buffer) of ``module``: where it computes now."""
    for param in module.parameters():
        return param.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device(default)


@functools.cache
def _device_class(device: torch.device) -> DeviceClass:
    if device.type == "cpu":
        return _cpu_class()
    if device.type == "cuda" and torch.cuda.is_available():
        return _cuda_class(device)
    # Devices lightning-comp has no rules for: nothing is assumed native; 16-bit plans run as the device allows.
    return DeviceClass(device.type, name=device.type, emulated=frozenset(_LOW))  # (no fp8: no _scaled_mm known)


def _cpu_class() -> DeviceClass:
    capability = cpu_capability()
    features = cpu_features()
    # The ISA ATen dispatches to bounds what runs natively: a CPU (or an ATEN_CPU_CAPABILITY) below AVX512 runs
    # BF16 through AVX2 code paths whatever cpuinfo lists.
    wide = capability.upper().startswith("AVX512")
    native = set()
    if wide and ({"avx512_bf16", "amx_tile"} & features):
        native.add(ComputePrecision.BF16)
    if wide and "amx_fp16" in features:
        native.add(ComputePrecision.FP16)
    used = tuple(f for f in ("avx512_bf16", "amx_tile", "amx_fp16") if f in features)
    # torch._scaled_mm has a CPU kernel on every class, emulating fp8 (several times slower than a bf16 matmul)
    return DeviceClass("cpu", name=cpu_name(), capability=capability, native=frozenset(native),
                       emulated=(frozenset(_LOW) - native) | frozenset(_FP8), features=used)


def _cuda_class(device: torch.device) -> DeviceClass:
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    native = set()
    if major >= 7:
        native.add(ComputePrecision.FP16)
    if major >= 8:
        native.add(ComputePrecision.BF16)
    if (major, minor) >= (8, 9):  # torch._scaled_mm's CUDA kernels: Ada (sm89), Hopper, Blackwell
        native.update(_FP8)
    emulated = set() if major >= 7 else {ComputePrecision.FP16}
    if ComputePrecision.BF16 not in native and torch.cuda.is_bf16_supported(including_emulation=True):
        emulated.add(ComputePrecision.BF16)
    return DeviceClass("cuda", name=torch.cuda.get_device_name(index), capability=f"sm{major}{minor}",
                       native=frozenset(native), emulated=frozenset(emulated))


def device_class(device: torch.device | str | nn.Module) -> DeviceClass:
    """The :class:`DeviceClass` of ``device`` (a device, a device string, or a module: where it is now).

    Probed once per device and process (``device_class.cache_clear()`` forgets the answers).
    """
    if isinstance(device, nn.Module):
        device = model_device(device)
    return _device_class(torch.device(device))


device_class.cache_clear = _device_class.cache_clear  # type: ignore[attr-defined]
