"""The precision plan: what each operator of a model computes in, saves for backward in, and keeps its parameters'
optimizer state and master copy in.

===============  ========================================================================================
module           what it holds
===============  ========================================================================================
``selectors``    how plans name operators: exact names, globs, ``"type:ClassName"``, and their precedence
``dimensions``   :class:`Dimension` (compute, saved, state, master) and :class:`Assignment`: one dimension's values
``entries``      the entries users write (``{selector: precision}`` or ``{selector: {dimension: value}}``), split
``fingerprint``  :class:`OperatorFingerprint`: the operators a plan was made for
``serialised``   the JSON document of a plan, and reading and writing plan files
``plan``         :class:`PrecisionPlan`: construction, queries, serialisation, summary
===============  ========================================================================================
"""

from lightning_comp.plan.dimensions import Assignment, Dimension
from lightning_comp.plan.fingerprint import OperatorFingerprint
from lightning_comp.plan.plan import PlanLike, PrecisionPlan, plan_from_any
from lightning_comp.plan.selectors import Selectors
from lightning_comp.plan.serialised import PLAN_FORMAT, PLAN_VERSION

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "Assignment", "Dimension", "OperatorFingerprint", "PlanLike", "PrecisionPlan",
           "Selectors", "plan_from_any"]
