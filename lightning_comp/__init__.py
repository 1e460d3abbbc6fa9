"""lightning-comp: convergence-aware, operator-wise mixed precision for PyTorch Lightning."""

from lightning_comp.casting import PlanExecutor, StepKind
from lightning_comp.dtypes import Precision, parse_precision
from lightning_comp.errors import (
    CoMPError,
    PlanError,
    PlanFileError,
    PlanMismatchError,
    SearchConfigError,
    UnsupportedSetupError,
)
from lightning_comp.operators import Lowering, OperatorInfo, OperatorKind, discover_operators, register_atomic
from lightning_comp.plan import OperatorFingerprint, PrecisionPlan
from lightning_comp.plugin import CoMPPrecision

__version__ = "0.1.0.dev0"

__all__ = [
    "CoMPError",
    "CoMPPrecision",
    "Lowering",
    "OperatorFingerprint",
    "OperatorInfo",
    "OperatorKind",
    "PlanError",
    "PlanExecutor",
    "PlanFileError",
    "PlanMismatchError",
    "Precision",
    "PrecisionPlan",
    "SearchConfigError",
    "StepKind",
    "UnsupportedSetupError",
    "discover_operators",
    "parse_precision",
    "register_atomic",
]
