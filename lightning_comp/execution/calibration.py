"""What the first step of each kind calibrated under a plan (:class:`Calibration`), per plan (:class:`Calibrations`).

The first step of each kind (train/validation/test/predict) after a plan is applied runs with every operator hooked
and traces which consumer receives each operator's output (:mod:`lightning_comp.execution.cast_boundaries`). What it
finds holds for every later step of that kind under the same model, plan and device (:class:`CastBoundaries`):

- the low-precision operators whose output stays low (*chained*) in steps of that kind: every consumer of it is an
  operator of the same low precision;
- the FP32 operators seen receiving a 16-bit input (*fed low*): they keep their hooks, which cast it back to FP32,
  while the other FP32 operators are unhooked (:mod:`lightning_comp.execution.hook_registry`).

Cast boundaries depend only on the model's call pattern and the plan's compute precisions: re-applying a plan seen
before (the search alternates plans) reuses its calibration instead of tracing again. Operators found by a tracing
step change the call pattern: every calibration is then forgotten (:meth:`Calibrations.forget`).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_comp.execution.executor import StepKind

__all__ = ["CastBoundaries", "Calibration", "Calibrations"]


@dataclass(frozen=True)
class CastBoundaries:
    """What one calibrating step found (see the module docstring).

    Attributes:
        chained: the low-precision operators whose output stays low in steps of its kind.
        fed_low: the FP32 operators seen receiving a 16-bit input (they keep their hooks).
    """

    chained: frozenset[str]
    fed_low: frozenset[str]


class Calibration:
    """The cast boundaries found by the calibrating step of each kind of step, under one model, plan and device."""

    __slots__ = ("_by_kind",)

    def __init__(self) -> None:
        self._by_kind: dict[StepKind, CastBoundaries] = {}

    def calibrated(self, kind: StepKind) -> bool:
        """Whether a step of ``kind`` calibrated (later steps of ``kind`` need not)."""
        return kind in self._by_kind

    def chained(self, kind: StepKind) -> frozenset[str]:
        """The low-precision operators whose output stays low in steps of ``kind`` (empty until calibrated)."""
        found = self._by_kind.get(kind)
        return frozenset() if found is None else found.chained

    def fed_low(self) -> frozenset[str]:
        """The FP32 operators seen receiving a 16-bit input in any kind of step calibrated so far."""
        return frozenset().union(*(found.fed_low for found in self._by_kind.values()))

    def record(self, kind: StepKind, found: CastBoundaries) -> None:
        """Keep what the calibrating step of ``kind`` found."""
        self._by_kind[kind] = found

    def clear(self) -> None:
        """Forget every kind's calibration (the next step of each kind calibrates again)."""
        self._by_kind.clear()

    def __bool__(self) -> bool:
        """Whether any kind of step calibrated."""
        return bool(self._by_kind)


class Calibrations:
    """The :class:`Calibration` of each (model, compute precisions, device) a plan was applied for."""

    __slots__ = ("_by_plan",)

    def __init__(self) -> None:
        self._by_plan: dict[tuple[Hashable, ...], Calibration] = {}

    def of(self, model: nn.Module, compute: Hashable, device: torch.device) -> Calibration:
        """The calibration of the plan whose compute precisions are ``compute`` on ``model`` and ``device``
        (empty the first time; a model that died never matches)."""
        return self._by_plan.setdefault((weakref.ref(model), compute, str(device)), Calibration())

    def forget(self) -> None:
        """Forget every calibration, in place (the call pattern they were found in changed)."""
        for calibration in self._by_plan.values():
            calibration.clear()
