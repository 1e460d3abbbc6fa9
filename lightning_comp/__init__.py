"""lightning-comp: convergence-aware, operator-wise mixed precision for PyTorch Lightning.

The package is layered; each package imports only those below it (``tests/unit/test_layers.py`` checks it):

==================  ================================================================================================
package             what it holds
==================  ================================================================================================
``search``          ``CoMPSearch``: the two-stage search for a model's plan (measurement, decisions, stages, record)
``plugins``         ``CoMPPrecision``/``CoMPFabricPrecision``: the Trainer's and Fabric's precision plugins
``distributed``     half-precision gradient traffic and the worker-scaled learning rate for DDP
``execution``       putting a plan into effect: hooks, cast boundaries, weight casts, saved tensors, loss scaling
``plan``            ``PrecisionPlan``: entries, selectors, fingerprint, file format
``devices``         device classes, CPU features, kernel probes, how each operator is lowered on each device
``operators``       which modules of a model are operators, and what each does
``numerics``        the precisions (compute, saved) and the codecs of saved tensors
``common``          enums spelled in configs, nested structures of tensors, tables, plain JSON values
``adapters``        every private torch and Lightning attribute the package touches
``errors``          the exceptions, all ``CoMPError``
==================  ================================================================================================

``zoo`` (models and data of the examples) and ``conf`` (the Hydra config tree) stand beside them.
"""

from lightning_comp.devices import DeviceClass, Lowering, device_class
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
    ConfigError,
    MissingExtraError,
    PlanError,
    PlanFileError,
    PlanMismatchError,
    SearchConfigError,
    SnapshotMismatchError,
    UnsupportedSetupError,
    UsageError,
)
from lightning_comp.execution import PlanExecutor, StepKind
from lightning_comp.numerics import ComputePrecision, MasterPrecision, SavedPrecision, StatePrecision, parse_precision
from lightning_comp.operators import OperatorInfo, OperatorKind, discover_operators, register_atomic
from lightning_comp.plan import OperatorFingerprint, PrecisionPlan, Selectors
from lightning_comp.plugins import CoMPFabricPrecision, CoMPFSDPPrecision, CoMPPrecision
from lightning_comp.search import CoMPSearch, Objective, SearchConfig, SearchState, TrialRecord
from lightning_comp.search.rewind.snapshot import TrainingSnapshot

__version__ = "0.1.0.dev0"

__all__ = [
    "CoMPError",
    "CoMPFSDPPrecision",
    "CoMPFabricPrecision",
    "CoMPPrecision",
    "CoMPSearch",
    "CommStats",
    "ConfigError",
    "DeviceClass",
    "GradCommDtype",
    "HalfPrecisionDDPStrategy",
    "Lowering",
    "MasterPrecision",
    "MissingExtraError",
    "Objective",
    "OperatorFingerprint",
    "OperatorInfo",
    "OperatorKind",
    "PlanError",
    "PlanExecutor",
    "PlanFileError",
    "PlanMismatchError",
    "ComputePrecision",
    "PrecisionPlan",
    "SavedPrecision",
    "SearchConfig",
    "SearchConfigError",
    "SearchState",
    "Selectors",
    "SnapshotMismatchError",
    "StatePrecision",
    "StepKind",
    "TrainingSnapshot",
    "TrialRecord",
    "UnsupportedSetupError",
    "UsageError",
    "WorkerScaledLR",
    "WorkerScaledLRConfig",
    "counting_comm_hook",
    "device_class",
    "discover_operators",
    "half_precision_ddp_strategy",
    "parse_precision",
    "register_atomic",
    "worker_scaled_lr",
]
