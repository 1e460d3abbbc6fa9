"""lightning-comp: convergence-aware, operator-wise mixed precision for PyTorch Lightning.

The names here are the ones a user holds in mind: the precision plugins (:class:`CoMPPrecision` for the Trainer,
:class:`CoMPFSDPPrecision` for ``FSDPStrategy``, :class:`CoMPFabricPrecision` for Fabric), the search
(:class:`CoMPSearch` and its :class:`SearchConfig`), the plan (:class:`PrecisionPlan` and its :class:`Dimension`)
and the errors (every one a :class:`CoMPError`). Everything else is imported from its sub-package:
``lightning_comp.operators`` (``discover_operators``, ``register_atomic``), ``lightning_comp.devices``
(``device_class``), ``lightning_comp.numerics`` (the precision enums), ``lightning_comp.distributed`` (DDP gradient
traffic, ``WorkerScaledLR``, FSDP2 policies). The packages and their import layers: ``docs/architecture.md``.
"""

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
from lightning_comp.plan import Dimension, PrecisionPlan
from lightning_comp.plugins import CoMPFabricPrecision, CoMPFSDPPrecision, CoMPPrecision
from lightning_comp.search import CoMPSearch, SearchConfig

__version__ = "0.1.0.dev0"

__all__ = [
    "CoMPError",
    "CoMPFSDPPrecision",
    "CoMPFabricPrecision",
    "CoMPPrecision",
    "CoMPSearch",
    "ConfigError",
    "Dimension",
    "MissingExtraError",
    "PlanError",
    "PlanFileError",
    "PlanMismatchError",
    "PrecisionPlan",
    "SearchConfig",
    "SearchConfigError",
    "SnapshotMismatchError",
    "UnsupportedSetupError",
    "UsageError",
]
