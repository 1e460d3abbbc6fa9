"""Lightning precision plugins that train with a precision plan, one plugin per module.

==========  ===========================================================================
module      plugin
========  =============================================================================
``comp``    :class:`CoMPPrecision`: the Trainer's plugin (single device, DDP, FSDP2 via ModelParallelStrategy)
``fsdp``    :class:`CoMPFSDPPrecision`: the same, in the form ``FSDPStrategy`` (FSDP1) accepts
``fabric``  :class:`CoMPFabricPrecision`: Lightning Fabric's plugin (a plan from a file or a mapping)
==========  ===========================================================================
"""

from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.plugins.fabric import CoMPFabricPrecision
from lightning_comp.plugins.fsdp import CoMPFSDPPrecision

__all__ = ["CoMPFSDPPrecision", "CoMPFabricPrecision", "CoMPPrecision"]
