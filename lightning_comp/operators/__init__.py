"""Operators: the units of work of a model that a precision plan assigns a precision to.

==============  ======================================================================================
module          what it holds
==============  ======================================================================================
``owned_work``  :class:`WorkRecorder`: the work each module does itself in a traced step (which containers
                compute between their children), with its floating-point operations counted
``kinds``       :class:`OperatorKind` and :func:`classify` (what an operator does), atomic modules
                (:func:`register_atomic`), Hugging Face's ``Conv1D`` known by class name
``discovery``   :func:`iter_operators`/:func:`discover_operators`: which modules of a model are operators
==============  ======================================================================================
"""

from lightning_comp.operators.discovery import OperatorInfo, discover_operators, iter_operators, operator_name
from lightning_comp.operators.kinds import OperatorKind, classify, register_atomic
from lightning_comp.operators.owned_work import OwnedWork, StepWork, WorkRecorder

__all__ = ["OperatorInfo", "OperatorKind", "OwnedWork", "StepWork", "WorkRecorder", "classify", "discover_operators",
           "iter_operators", "operator_name", "register_atomic"]
