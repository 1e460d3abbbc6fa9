"""The precision plan: which precision each operator of a model computes in, and stores its saved tensors in.

===============  ========================================================================================
module           what it holds
===============  ========================================================================================
``selectors``    how plans name operators: exact names, globs, ``"type:ClassName"``, and their precedence
``entries``      parsing a plan's entries (``{selector: precision}`` or ``{selector: {"compute", "saved"}}``)
``fingerprint``  :class:`OperatorFingerprint`: the operators a plan was made for
``serialised``   the JSON document of a plan, and reading and writing plan files
``plan``         :class:`PrecisionPlan`: construction, queries, serialisation, summary
===============  ========================================================================================
"""

from lightning_comp.plan.fingerprint import OperatorFingerprint
from lightning_comp.plan.plan import PlanLike, PrecisionPlan, plan_from_any
from lightning_comp.plan.selectors import Selectors
from lightning_comp.plan.serialised import PLAN_FORMAT, PLAN_VERSION

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "OperatorFingerprint", "PlanLike", "PrecisionPlan", "Selectors",
           "plan_from_any"]
