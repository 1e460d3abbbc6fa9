"""Putting a plan into effect for one measured configuration of the batch stage."""

from __future__ import annotations

from typing import Any

from lightning_comp.execution.executor import StepKind
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plugins.comp import CoMPPrecision

__all__ = ["activate", "with_weight_recording"]


def with_weight_recording(plugin: CoMPPrecision, plan: PrecisionPlan) -> Any:
    """Put ``plan`` into effect; return the context in which training saves lowered weights (for the profiler)."""
    plugin._set_search_plan(plan)
    return plugin.executor.weight_cast_recording()


def activate(plugin: CoMPPrecision, plan: PrecisionPlan) -> Any:
    """Put ``plan`` into effect and return the context of a calibrated training step (for ``StepTimer``)."""
    plugin._set_search_plan(plan)
    return plugin.executor.step(StepKind.TRAIN)
