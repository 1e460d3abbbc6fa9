"""What executing a plan tells the user when the plan does less than it says, each once: :class:`PlanWarnings`.

- A plan that lowers nothing on the model and device it is applied for (its 16-bit entries match only shape-only
  operators, or operators with no low-precision kernel there): said once per plan and device.
- Plan entries without effect, found by a calibrating step: an operator assigned a 16-bit precision that computed
  in float32 all the same. Said once per operator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_comp.execution.hooks import HookedOperator
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["PlanWarnings"]


class PlanWarnings:
    """The warnings of one executor, each given once (see the module docstring)."""

    __slots__ = ("_ineffective", "_nothing_lowered")

    def __init__(self) -> None:
        self._ineffective: set[str] = set()  # operators whose plan entry had no effect
        self._nothing_lowered: set[tuple[Any, ...]] = set()  # compute assignments (and devices) that lowered nothing

    def nothing_lowered(self, model: nn.Module, plan: PrecisionPlan, operators: Mapping[str, HookedOperator],
                        device: torch.device) -> None:
        """Warn if ``plan`` assigns a 16-bit precision but none of ``operators`` (``model``'s, on ``device``)
        computes in one."""
        compute = plan[Dimension.COMPUTE]
        said = (compute.entries, compute.default, str(device))
        if not plan.is_all_fp32 and not any(op.low and not op.transparent for op in operators.values()) \
                and said not in self._nothing_lowered:
            self._nothing_lowered.add(said)
            low = sorted({p.value for p in compute.values()
                          if p is not ComputePrecision.FP32})
            rank_zero_warn(
                f"The plan assigns {'/'.join(low)} but no operator of {type(model).__name__} computes in it on"
                f" {device}: its 16-bit entries match only shape-only operators, or operators with no"
                " low-precision kernel there. Training runs in fp32.",
                stacklevel=2,
            )

    def ineffective(self, names: set[str], operators: Mapping[str, HookedOperator]) -> None:
        """Warn about the operators ``names`` (of ``operators``) that computed in float32 although planned 16-bit,
        those not warned about yet."""
        fresh = sorted(names - self._ineffective)
        if fresh:
            self._ineffective.update(fresh)
            described = ", ".join(f"{n} ({type(operators[n].module).__name__})" for n in fresh)
            rank_zero_warn(
                f"Plan entries had no effect: {described} computed in float32 although the plan assigns a 16-bit"
                " precision (PyTorch has no lower-precision kernel for them on this device, or they do no"
                " floating-point work). Assign them 'fp32' to silence this warning.",
                stacklevel=2,
            )
