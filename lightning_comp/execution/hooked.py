"""The run-time state of one operator the executor has hooked."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_comp.devices.lowering import Lowering
from lightning_comp.numerics.precision import Precision, SavedPrecision
from lightning_comp.operators.kinds import OperatorKind

__all__ = ["HookedOperator"]


@dataclass(eq=False)
class HookedOperator:
    """One hooked operator: what it computes in, how that is put into effect, what it saves in.

    Attributes:
        name: the operator's name in the plan.
        module: the module.
        kind: what it does.
        precision: the precision the plan assigns it.
        lowering: how that precision is put into effect on the device (``NONE``: it computes in FP32).
        saved: the precision it stores its saved tensors in.
        contexts: the contexts its pre-hook entered, left by its post-hook (a stack: a module may call itself).
    """

    name: str
    module: nn.Module
    kind: OperatorKind
    precision: Precision
    lowering: Lowering
    saved: SavedPrecision = SavedPrecision.FP32
    contexts: list[AbstractContextManager[Any]] = field(default_factory=list)

    @property
    def low(self) -> bool:
        """Whether it computes in a 16-bit precision."""
        return self.lowering is not Lowering.NONE

    @property
    def transparent(self) -> bool:
        """Whether it only reshapes (its output has its input's dtype, whatever the plan says)."""
        return self.kind is OperatorKind.SHAPE
