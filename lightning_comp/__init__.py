"""lightning-comp: convergence-aware, operator-wise mixed precision for PyTorch Lightning."""

from lightning_comp.devices.device_class import DeviceClass, device_class
from lightning_comp.distributed.grad_compression import (
    CommStats,
    GradCommDtype,
    HalfPrecisionDDPStrategy,
    counting_comm_hook,
    half_precision_ddp_strategy,
)
from lightning_comp.distributed.lr_schedule import WorkerScaledLR, WorkerScaledLRConfig, worker_scaled_lr
from lightning_comp.errors import (
    CoMPError,
    PlanError,
    PlanFileError,
    PlanMismatchError,
    SearchConfigError,
    SnapshotMismatchError,
    UnsupportedSetupError,
)
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.numerics.precision import Precision, parse_precision
from lightning_comp.operators.discovery import Lowering, OperatorInfo, OperatorKind, discover_operators, register_atomic
from lightning_comp.plan.plan import OperatorFingerprint, PrecisionPlan
from lightning_comp.plan.selectors import Selectors
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search import CoMPSearch, Objective, SearchConfig, SearchState, TrialRecord
from lightning_comp.search.rewind.snapshot import TrainingSnapshot

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
