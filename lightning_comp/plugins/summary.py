"""What a Lightning user's logger keeps of a plan: flat hyperparameters, the same for a given plan and a search's.

``Trainer.precision`` stays Lightning's literal ``"32-true"`` under :class:`~lightning_comp.CoMPPrecision` (the
master weights' precision): Lightning's ``ModelSummary`` warns on any other string at every fit and counts parameters
at 32 bits anyway, ``ThroughputMonitor`` and the FSDP plugin read it as a literal. What the run computes in is
:data:`COMP_PRECISION` (``"comp-mixed"``) where the plan lowers anything, the plugin's ``precision_label``, and
:func:`plan_hyperparameters` is what goes to ``logger.log_hyperparams`` once the plan is known:

- ``comp/precision``: ``"comp-mixed"`` or ``"32-true"`` (a plan that changes nothing from FP32 training);
- ``comp/plan/<selector>`` and ``comp/plan/<default>``: the compute precision per plan entry (operator group), and
  ``comp/saved/<selector>``, ``comp/state/<selector>``, ``comp/master/<selector>`` where the plan sets them;
- ``comp/operators`` and ``comp/lowered_operators``: operators hooked, and of them computing in 16 bits (once the
  plan is hooked on the model; the plan's entries alone before);
- ``comp/device_class``: the class of the device the plan runs on (``"cpu AVX2 (AMD EPYC; no native 16-bit)"``);
- ``comp/plan_fingerprint``: a short hash of what the plan assigns (two runs with the same value trained the same
  plan), and ``comp/model_fingerprint``: the digest of the operators the plan was made for (``""`` when unbound).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from lightning_comp.devices.device_classes import DeviceClass
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["COMP_PRECISION", "FP32_PRECISION", "plan_fingerprint", "plan_hyperparameters", "precision_label"]

#: What a run under a plan that lowers anything computes in (Lightning's ``Trainer.precision`` stays ``"32-true"``).
COMP_PRECISION = "comp-mixed"
#: What a run under a plan that changes nothing from FP32 training computes in.
FP32_PRECISION = "32-true"

_PREFIXES = {Dimension.COMPUTE: "comp/plan", Dimension.SAVED: "comp/saved", Dimension.STATE: "comp/state",
             Dimension.MASTER: "comp/master"}


def precision_label(plan: PrecisionPlan) -> str:
    """:data:`COMP_PRECISION` where ``plan`` changes anything from FP32 training (any dimension), else
    :data:`FP32_PRECISION`."""
    return COMP_PRECISION if any(a.changes for a in plan.assignments) else FP32_PRECISION


def plan_fingerprint(plan: PrecisionPlan) -> str:
    """A short stable hash (16 hex digits) of what ``plan`` assigns in every dimension (notes and binding aside)."""
    assigned = {a.dimension.value: {"entries": a.to_dict(), "default": a.default.value} for a in plan.assignments}
    return hashlib.sha256(json.dumps(assigned, sort_keys=True).encode()).hexdigest()[:16]


def plan_hyperparameters(plan: PrecisionPlan, precisions: Mapping[str, ComputePrecision] | None = None,
                         device: DeviceClass | None = None) -> dict[str, Any]:
    """The flat hyperparameters of ``plan`` (see the module docstring), plain ``str``/``int`` values only.

    Args:
        plan: the plan in force.
        precisions: each hooked operator's effective precision (``executor.precisions()``), if hooked.
        device: the class of the device it runs on, if known.
    """
    params: dict[str, Any] = {"comp/precision": precision_label(plan)}
    for assignment in plan.assignments:
        prefix = _PREFIXES[assignment.dimension]
        if assignment.dimension is Dimension.COMPUTE or assignment.changes:
            params.update({f"{prefix}/{selector}": value for selector, value in assignment.to_dict().items()})
            params[f"{prefix}/<default>"] = assignment.default.value
    if precisions:
        params["comp/operators"] = len(precisions)
        params["comp/lowered_operators"] = sum(1 for p in precisions.values() if p.is_low)
    params["comp/device_class"] = "" if device is None else device.describe()
    params["comp/plan_fingerprint"] = plan_fingerprint(plan)
    params["comp/model_fingerprint"] = "" if plan.fingerprint is None else plan.fingerprint.digest
    return params
