"""Executing a precision plan on a model: hooks, cast boundaries, weight casts, saved tensors, recomputation,
optimizer state and master weights, loss scaling.

:class:`PlanExecutor` puts a plan into effect on a model through forward hooks per operator (:class:`StepKind` names the
kind of step it runs); the precision plugins drive it. ``docs/architecture.md`` ("Following one training step") reads
a step through this package's modules in the order the step meets them; each module's docstring says what it holds.
"""

from lightning_comp.execution.executor import PlanExecutor, StepKind

__all__ = ["PlanExecutor", "StepKind"]
