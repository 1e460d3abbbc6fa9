"""Operators: the units of work of a model that a precision plan assigns a precision to.

==============  ======================================================================================
module          what it holds
==============  ======================================================================================
``kinds``       :class:`OperatorKind` and :func:`classify` (what an operator does), atomic modules
                (:func:`register_atomic`), third-party modules known by class name
``discovery``   :func:`iter_operators`/:func:`discover_operators`: which modules of a model are operators
==============  ======================================================================================
"""

from lightning_comp.operators.discovery import OperatorInfo, discover_operators, iter_operators, operator_name
from lightning_comp.operators.kinds import OperatorKind, classify, register_atomic

__all__ = ["OperatorInfo", "OperatorKind", "classify", "discover_operators", "iter_operators", "operator_name",
           "register_atomic"]
