"""lightning-comp: convergence-aware, operator-wise mixed precision for PyTorch Lightning."""

from lightning_comp.casting import PlanExecutor, StepKind
from lightning_comp.devices import DeviceClass, device_class
from lightning_comp.dtypes import Precision, parse_precision
from lightning_comp.errors import (
    CoMPError,
    PlanError,
    PlanFileError,
    PlanMismatchError,
    SearchConfigError,
    SnapshotMismatchError,
    UnsupportedSetupError,
)
from lightning_comp.grad_compression import (
    CommStats,
    GradCommDtype,
    HalfPrecisionDDPStrategy,
    counting_comm_hook,
    half_precision_ddp_strategy,
)
from lightning_comp.lr_schedule import WorkerScaledLR, WorkerScaledLRConfig, worker_scaled_lr
from lightning_comp.operators import Lowering, OperatorInfo, OperatorKind, discover_operators, register_atomic
from lightning_comp.plan import OperatorFingerprint, PrecisionPlan
from lightning_comp.plugin import CoMPPrecision
from lightning_comp.search import CoMPSearch, Objective, SearchConfig, SearchState, TrialRecord
from lightning_comp.selectors import Selectors
from lightning_comp.snapshot import TrainingSnapshot

__version__ = "0.1.0.dev0"

__all__ = [
    "CommStats",
    "GradCommDtype",
    "HalfPrecisionDDPStrategy",
    "WorkerScaledLR",
    "WorkerScaledLRConfig",
    "counting_comm_hook",
    "half_precision_ddp_strategy",
    "worker_scaled_lr",
    "CoMPError",
    "CoMPPrecision",
    "CoMPSearch",
    "DeviceClass",
    "device_class",
    "Lowering",
    "OperatorFingerprint",
    "OperatorInfo",
    "OperatorKind",
    "Objective",
    "PlanError",
    "PlanExecutor",
    "PlanFileError",
    "PlanMismatchError",
    "Precision",
    "PrecisionPlan",
    "SearchConfig",
    "SearchConfigError",
    "SearchState",
    "Selectors",
    "SnapshotMismatchError",
    "TrialRecord",
    "StepKind",
    "TrainingSnapshot",
    "UnsupportedSetupError",
    "discover_operators",
    "parse_precision",
    "register_atomic",
]
