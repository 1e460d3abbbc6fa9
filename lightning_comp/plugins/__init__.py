"""Lightning precision plugins that train with a precision plan, one plugin per module.

========  =============================================================================
module    plugin
========  =============================================================================
``comp``  :class:`CoMPPrecision`: the Trainer's plugin (single device, DDP)
========  =============================================================================
"""

from lightning_comp.plugins.comp import CoMPPrecision

__all__ = ["CoMPPrecision"]
