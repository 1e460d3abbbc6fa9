"""The precision plan: what each operator of a model computes in, saves for backward in, and keeps its parameters'
optimizer state and master copy in.

A :class:`PrecisionPlan` maps each :class:`Dimension` (compute, saved, state, master) to an :class:`Assignment`
(selector -> value entries and a default); :class:`Selectors` name operators, an :class:`OperatorFingerprint` records
the operators a plan was made for, and only the serialiser knows the JSON document's field names. Each module's
docstring says what it holds.
"""

from lightning_comp.plan.dimensions import Assignment, Dimension
from lightning_comp.plan.fingerprint import OperatorFingerprint
from lightning_comp.plan.plan import PlanLike, PrecisionPlan, plan_from_any
from lightning_comp.plan.selectors import Selectors
from lightning_comp.plan.serialised import PLAN_FORMAT, PLAN_VERSION

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "Assignment", "Dimension", "OperatorFingerprint", "PlanLike", "PrecisionPlan",
           "Selectors", "plan_from_any"]
