"""Operators: the units of work of a model that a precision plan assigns a precision to.

:func:`discover_operators` lists a model's operators (leaf modules, modules treated whole: :func:`register_atomic`, and
containers a traced step finds computing between their children); :class:`OperatorKind` says what each does, which
decides how a low precision can apply to it. Each module's docstring says what it holds.
"""

from lightning_comp.operators.discovery import OperatorInfo, discover_operators, iter_operators, operator_name
from lightning_comp.operators.kinds import OperatorKind, classify, register_atomic
from lightning_comp.operators.owned_work import OwnedWork, StepWork, WorkRecorder

__all__ = ["OperatorInfo", "OperatorKind", "OwnedWork", "StepWork", "WorkRecorder", "classify", "discover_operators",
           "iter_operators", "operator_name", "register_atomic"]
