"""The precisions a plan can assign, and how they map to torch dtypes and devices."""

from __future__ import annotations

from enum import Enum

import torch

from lightning_comp.errors import PlanError

__all__ = ["Precision", "parse_precision", "device_supports_fast"]


class Precision(str, Enum):
    """A compute precision for one operator.

    The value is the spelling used in plans, configs and JSON files.
    """

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype the operator computes in."""
        return _TO_DTYPE[self]

    @property
    def is_low(self) -> bool:
        """Whether this is a 16-bit precision (anything but FP32)."""
        return self is not Precision.FP32

    def __str__(self) -> str:
        return self.value


_TO_DTYPE = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
_ALIASES = {
    "fp32": Precision.FP32,
    "float32": Precision.FP32,
    "32": Precision.FP32,
    "bf16": Precision.BF16,
    "bfloat16": Precision.BF16,
    "fp16": Precision.FP16,
    "float16": Precision.FP16,
    "half": Precision.FP16,
    "16": Precision.FP16,
}


def parse_precision(value: object) -> Precision:
    """Turn a user-facing value into a :class:`Precision`.

    Args:
        value: a :class:`Precision`, a torch dtype (float32/bfloat16/float16) or one of the strings
            ``"fp32"``, ``"bf16"``, ``"fp16"`` (aliases ``float32``, ``bfloat16``, ``float16``, ``half`` are accepted).

    Raises:
        PlanError: if the value names no supported precision.
    """
    if isinstance(value, Precision):
        return value
    if isinstance(value, torch.dtype):
        for precision, dtype in _TO_DTYPE.items():
            if dtype == value:
                return precision
        raise PlanError(f"Unsupported dtype {value!r}: valid dtypes are torch.float32, torch.bfloat16, torch.float16.")
    if isinstance(value, str) and value.strip().lower() in _ALIASES:
        return _ALIASES[value.strip().lower()]
    raise PlanError(f"Unknown precision {value!r}: valid precisions are 'fp32', 'bf16' and 'fp16'.")


def device_supports_fast(precision: Precision, device_type: str) -> bool:
    """Whether ``precision`` is expected to be *faster* than FP32 on this kind of device.

    Shorthand for ``device_class(device_type).is_native(precision)`` (see :mod:`lightning_comp.devices.device_class`):
    CUDA devices of compute capability >= 7.0 run FP16 natively, >= 8.0 also BF16; CPUs run BF16 natively only with
    AVX512-BF16 or AMX (and AVX512 dispatch), FP16 only with AMX-FP16.
    """
    if precision is Precision.FP32:
        return True
    from lightning_comp.devices.device_class import device_class  # devices builds on this module

    return device_class(device_type).is_native(precision)
