"""Plans moved between machines: warn, once, when a plan's 16-bit precision is emulated where it now runs.

A plan searched on an AMX server or an A100 lowers the operators for which 16-bit paid *there*. Loaded on a laptop
whose CPU has only AVX2, BF16 is emulated (30-100x slower than FP32 for a matmul): the plan still computes
correctly, but it is no longer a speed-up, and the search would choose differently. :func:`check_plan_device` names
the operators concerned and both devices, and suggests searching again.
"""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_comp.devices.device_class import DeviceClass
from lightning_comp.numerics.precision import Precision
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["check_plan_device", "emulated_operators"]

_WARNED: set[tuple[str, str, str]] = set()


def emulated_operators(plan: PrecisionPlan, model: nn.Module, device: DeviceClass) -> dict[str, str]:
    """``{operator: precision}`` for the operators ``plan`` lowers to a precision ``device`` does not run natively."""
    out = {}
    modules = dict(iter_operators(model))
    for name in plan.low_operators(model):
        module = modules[name]
        precision = plan.precision_of(name, type(module))
        if not device.is_native(precision):
            out[name] = precision.value
    return out


def check_plan_device(plan: PrecisionPlan, model: nn.Module, device: DeviceClass, stacklevel: int = 2,
                      accepted: frozenset[Precision] = frozenset()) -> str | None:
    """Warn (once per plan and device class in this process) if ``plan`` lowers operators to a 16-bit precision that
    ``device`` emulates; return the warning's text, or ``None`` when every lowered operator runs natively.

    Precisions in ``accepted`` are not reported (the user insisted on them, e.g. ``allow_slow_fp16=True``).
    """
    emulated = {name: p for name, p in emulated_operators(plan, model, device).items()
                if Precision(p) not in accepted}
    if not emulated:
        return None
    key = (repr(plan), plan.fingerprint.digest if plan.fingerprint else "", device.describe())
    precisions = "/".join(sorted(set(emulated.values())))
    names = ", ".join(list(emulated)[:8]) + (f", ... ({len(emulated)} in all)" if len(emulated) > 8 else "")
    if plan.device is not None and plan.device != device:
        origin = f" (made on {plan.device.describe()})"
    elif plan.device is None and plan.device_type:
        origin = f" (made on a {plan.device_type} device)"
    else:
        origin = ""
    message = (
        f"This precision plan{origin} computes {len(emulated)} operator(s) in {precisions} on"
        f" {device.describe()}, where {precisions} is emulated, not native: {names}. Training is correct but"
        " likely slower than fp32. Search again on this machine (CoMPSearch()), or assign those operators 'fp32'."
    )
    if key not in _WARNED:
        _WARNED.add(key)
        rank_zero_warn(message, stacklevel=stacklevel + 1)
    return message
