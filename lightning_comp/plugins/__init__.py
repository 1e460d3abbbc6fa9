"""Lightning precision plugins that train with a precision plan, one plugin per module: :class:`CoMPPrecision` (the
Trainer's: single device, DDP, FSDP2), :class:`CoMPFSDPPrecision` (its form for ``FSDPStrategy``, FSDP1) and
:class:`CoMPFabricPrecision` (Fabric's). Each is a thin shell that maps its framework's hooks onto one
:class:`~lightning_comp.plugins.runtime.PlanRuntime`; each module's docstring says what it holds.
"""

from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.plugins.fabric import CoMPFabricPrecision
from lightning_comp.plugins.fsdp import CoMPFSDPPrecision

__all__ = ["CoMPFSDPPrecision", "CoMPFabricPrecision", "CoMPPrecision"]
