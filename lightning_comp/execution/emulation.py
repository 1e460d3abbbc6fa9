"""A plan on a device where its 16-bit precision is emulated: warn (BF16), or run FP32 instead (FP16).

A plan searched on an AMX server or an A100 lowers the operators for which 16-bit paid *there*. Loaded on a laptop
whose CPU has only AVX2, BF16 is emulated (30-100x slower than FP32 for a matmul): the plan still computes
correctly, but it is no longer a speed-up, and the search would choose differently. :func:`check_plan_device` names
the operators concerned and both devices, and suggests searching again. FP16 on a device without fast FP16 is a
trap worse than slowness (a CPU's FP16 convolution backward runs a reference kernel ~100x slower than FP32), so
:func:`decline_slow_fp16` runs those entries in FP32, unless the user insists.
"""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_comp.devices.device_classes import DeviceClass
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["check_plan_device", "decline_slow_fp16", "emulated_operators"]

_WARNED: set[tuple[str, str, str]] = set()


def emulated_operators(plan: PrecisionPlan, model: nn.Module, device: DeviceClass) -> dict[str, ComputePrecision]:
    """``{operator: precision}`` for the operators ``plan`` lowers to a precision ``device`` does not run natively."""
    out = {}
    modules = dict(iter_operators(model))
    for name in plan.low_operators(model):
        module = modules[name]
        precision = plan.of(Dimension.COMPUTE, name, type(module))
        if not device.is_native(precision):
            out[name] = precision
    return out


def check_plan_device(plan: PrecisionPlan, model: nn.Module, device: DeviceClass, stacklevel: int = 2,
                      accepted: frozenset[ComputePrecision] = frozenset()) -> str | None:
    """Warn (once per plan and device class in this process) if ``plan`` lowers operators to a 16-bit precision that
    ``device`` emulates; return the warning's text, or ``None`` when every lowered operator runs natively.

    Precisions in ``accepted`` are not reported (the user insisted on them, e.g. ``allow_slow_fp16=True``).
    """
    emulated = {name: p for name, p in emulated_operators(plan, model, device).items() if p not in accepted}
    if not emulated:
        return None
    key = (repr(plan), plan.fingerprint.digest if plan.fingerprint else "", device.describe())
    precisions = "/".join(sorted({p.value for p in emulated.values()}))
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


def decline_slow_fp16(plan: PrecisionPlan, device: DeviceClass, allow: bool) -> PrecisionPlan:
    """``plan`` with its FP16 entries (and default) turned FP32 where ``device`` has no fast FP16, with a warning,
    unless ``allow``. Everything else of the plan (saved precisions, fingerprint, provenance) is kept."""
    if allow or not plan.uses(ComputePrecision.FP16) or device.is_native(ComputePrecision.FP16):
        return plan
    rank_zero_warn(
        f"The plan assigns fp16 but this device, {device.describe()}, has no fast fp16 (on CPUs without"
        " AMX-FP16, fp16 matmuls run at ~1x fp32 and fp16 convolution backward ~100x slower): those entries run"
        " in fp32. Use 'bf16', or pass CoMPPrecision(allow_slow_fp16=True) to insist.",
        stacklevel=4,
    )
    compute = plan[Dimension.COMPUTE]
    entries = {s: ComputePrecision.FP32 if p is ComputePrecision.FP16 else p for s, p in compute.entries}
    default = ComputePrecision.FP32 if compute.default is ComputePrecision.FP16 else compute.default
    declined = plan.with_assignment(Dimension.COMPUTE, entries, default)
    return declined.with_provenance(declined_fp16=True)
