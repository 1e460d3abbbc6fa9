"""How a low precision is put into effect for each kind of operator on each device: its :class:`Lowering`.

=================================  ==========================================================================
operator                           lowering
=================================  ==========================================================================
Linear, Conv, attention            an autocast region (parameter copies where the device has no autocast)
a container's own work             an autocast region around its forward, in which each child operator keeps
(``FUNCTIONAL``)                   its own precision (none where the device has no autocast)
LSTM, GRU, RNN                     the first way that runs on the device, tried on a tiny copy
                                   (:mod:`lightning_comp.devices.kernel_probes`): autocast, else parameter copies
norms                              a cast of the input (FP32 affine parameters and statistics) where the kernels
                                   take mixed dtypes (any CPU; batch norms everywhere), else parameter copies
element-wise ops                   a cast of the input
embeddings                         computed in FP32, the output cast (identical numerics, a cheaper output)
other modules with weights         parameter copies
shape-only modules, FP32           nothing
=================================  ==========================================================================
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from lightning_comp.devices.kernel_probes import probe_recurrent
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.kinds import OperatorKind, autocast_like, classify, is_recurrent, normalises_input_only

__all__ = ["Lowering", "autocast_available", "lowering_for", "why_not_lowerable"]


class Lowering(str, Enum):
    """How a low precision is put into effect for one operator (never by changing its parameters: they keep the
    plan's ``master`` precision, FP32 unless it says ``bf16``)."""

    AUTOCAST = "autocast"  # a torch.autocast region around the call: weights cast per call, FP32 grads
    INPUT = "input"  # floating inputs cast to the low dtype; parameters/statistics stay FP32 (mixed kernels)
    PARAMS = "params"  # inputs cast and the forward run with low-precision copies of the FP32 parameters
    OUTPUT = "output"  # computed in FP32, output emitted in the low dtype (look-ups: identical numerics, cheaper)
    NONE = "none"  # nothing to lower: precision passes through


def lowering_for(module: nn.Module, precision: ComputePrecision, device: torch.device | str) -> Lowering | None:
    """How ``precision`` is put into effect for ``module`` on ``device`` (a device, or a device type string).

    Returns ``Lowering.NONE`` for FP32 and for shape-only operators, and ``None`` when no way of lowering the operator
    runs on that device (:func:`why_not_lowerable` says why). Recurrent operators are decided by trying each way on a
    tiny copy on the device: CPU autocast cannot run a BF16 ``nn.LSTM`` on AVX2-only CPUs, where BF16 parameter copies
    can.
    """
    kind = classify(module)
    if precision is ComputePrecision.FP32 or kind is OperatorKind.SHAPE:
        return Lowering.NONE
    target = torch.device(device)
    if is_recurrent(module):
        route = probe_recurrent(module, precision, target).route
        return None if route is None else Lowering(route)
    if kind is OperatorKind.FUNCTIONAL:  # calls between its children: only an autocast region reaches them
        return Lowering.AUTOCAST if autocast_available(target.type) else None
    if autocast_like(module):  # where torch has no autocast, parameter copies do the same work
        return Lowering.AUTOCAST if autocast_available(target.type) else Lowering.PARAMS
    if kind is OperatorKind.NORM:
        # CPU kernels accept a 16-bit input with FP32 affine parameters; CUDA LayerNorm/GroupNorm do not.
        return Lowering.INPUT if normalises_input_only(module) or target.type == "cpu" else Lowering.PARAMS
    if kind is OperatorKind.EMBEDDING:
        return Lowering.OUTPUT
    if kind is OperatorKind.ELEMENTWISE:
        return Lowering.INPUT
    return Lowering.PARAMS


def why_not_lowerable(module: nn.Module, precision: ComputePrecision, device: torch.device | str) -> str:
    """Why :func:`lowering_for` found no way of lowering ``module`` (what each way tried raised), for messages."""
    if is_recurrent(module):
        failures = probe_recurrent(module, precision, torch.device(device)).describe_failures()
        if failures:
            return failures
    if classify(module) is OperatorKind.FUNCTIONAL:
        return (f"its own work (functional calls between its children) is lowered by an autocast region, and torch has"
                f" no autocast for {torch.device(device).type}")
    return f"no way of lowering a {type(module).__name__} to {precision.value} runs there"


def autocast_available(device_type: str) -> bool:
    """Whether torch has an autocast for ``device_type``."""
    available = getattr(torch.amp, "isautocast_available", None)  # public since torch 2.4
    return device_type in ("cpu", "cuda") if available is None else bool(available(device_type))
