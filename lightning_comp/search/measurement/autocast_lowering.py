"""What one global autocast region (PyTorch AMP, Lightning's ``bf16-mixed``/``16-mixed``) lowers in the user's step.

The batch stage times AMP's plan as a whole-step alternative, so that the chosen plan is never slower than the fixed
policy a user would otherwise pick. AMP's plan is not a list of module types: under one region, an op on autocast's
lower-precision list (matmul, convolution, attention, recurrent cells) computes in 16 bits, an op on its FP32 list
(on CUDA ``layer_norm``, ``softmax``, most losses) in FP32, and every other op (activations, CPU norms, dropout,
pooling) in the dtype its inputs arrive in, which depends on the model's data flow: a LayerNorm after a lowered
Linear computes in 16 bits, the same LayerNorm after a residual add (FP32 + BF16 promotes to FP32) in FP32. So it is
observed, not predicted: one training step runs under a global region and every operator whose forward returns a
tensor of the low dtype is one AMP lowers. A ``FUNCTIONAL`` operator (a container computing between its children:
attention) is lowered too, as autocast lowers its matmuls and attention kernels whatever it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from lightning_comp.common.nested import tensors
from lightning_comp.devices.lowering import autocast_available
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.kinds import is_functional

__all__ = ["lowered_under_autocast"]


def lowered_under_autocast(modules: Mapping[str, nn.Module], step: Callable[[], None], device_type: str,
                           low: ComputePrecision) -> frozenset[str]:
    """The operators that one global autocast region of ``low`` lowers in ``step``.

    Args:
        modules: the model's operators by name (the model computes in FP32 while ``step`` runs: no plan in force).
        step: one training step (forward and backward) of the user's.
        device_type: where the model computes (``"cpu"``, ``"cuda"``).
        low: the 16-bit precision of the region.

    Returns:
        Their names (empty where the device has no autocast).
    """
    if not autocast_available(device_type) or not low.is_low:
        return frozenset()
    dtype = low.dtype
    lowered: set[str] = {name for name, module in modules.items() if is_functional(module)}

    def watcher(name: str) -> Callable[[nn.Module, object, object], None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            if name not in lowered and any(t.dtype == dtype for t in tensors(output)):
                lowered.add(name)

        return hook

    handles = [module.register_forward_hook(watcher(name)) for name, module in modules.items()]
    try:
        with torch.autocast(device_type, dtype=dtype):
            step()
    finally:
        for handle in handles:
            handle.remove()
    return frozenset(lowered)
