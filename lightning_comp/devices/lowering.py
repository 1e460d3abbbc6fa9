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

The fp8 precisions (``fp8``, ``fp8-rowwise``) lower ``nn.Linear`` operators (and Hugging Face's ``Conv1D``) only,
whose in and out features are multiples of 16 (the sizes ``torch._scaled_mm``'s CUDA kernels take): the input is cast
to bf16 and the operator's ``F.linear`` (``Conv1D``: ``torch.addmm``) call computes through torchao's float8 matmul
(:mod:`lightning_comp.adapters.torchao_float8`), with the FP32 (or bf16) master weight scaled to fp8 at each call.
Any other operator has no fp8 lowering (:func:`fp8_refusal` says why); plans assign it ``bf16`` instead.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from lightning_comp.devices.device_classes import device_class
from lightning_comp.devices.kernel_probes import probe_recurrent
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.kinds import (
    OperatorKind,
    autocast_like,
    classify,
    is_recurrent,
    linear_sizes,
    normalises_input_only,
)

__all__ = ["FP8_MULTIPLE", "Lowering", "autocast_available", "fp8_refusal", "lowering_for", "why_not_lowerable"]

#: fp8 matmul kernels (``torch._scaled_mm`` on CUDA) take operands whose inner and outer sizes are multiples of this.
FP8_MULTIPLE = 16


class Lowering(str, Enum):
    """How a low precision is put into effect for one operator (never by changing its parameters: they keep the
    plan's ``master`` precision, FP32 unless it says ``bf16``)."""

    AUTOCAST = "autocast"  # a torch.autocast region around the call: weights cast per call, FP32 grads
    INPUT = "input"  # floating inputs cast to the low dtype; parameters/statistics stay FP32 (mixed kernels)
    PARAMS = "params"  # inputs cast and the forward run with low-precision copies of the FP32 parameters
    OUTPUT = "output"  # computed in FP32, output emitted in the low dtype (look-ups: identical numerics, cheaper)
    FLOAT8 = "float8"  # inputs cast to bf16, the F.linear call computed with float8 operands (dynamic scales)
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
    if precision.is_fp8:
        return Lowering.FLOAT8 if fp8_refusal(module, target) is None else None
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
    if precision.is_fp8:
        return fp8_refusal(module, torch.device(device)) or "it computes in fp8 there"
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


def fp8_refusal(module: nn.Module, device: torch.device | str | None = None) -> str | None:
    """Why ``module`` cannot compute in fp8 (on ``device``, when given), for messages; ``None`` when it can: an
    ``nn.Linear`` (or Hugging Face's ``Conv1D``, a Linear with its weight transposed) whose in and out features are
    multiples of :data:`FP8_MULTIPLE`, on a device with fp8 matmuls."""
    sizes = linear_sizes(module)
    if sizes is None:
        return (f"fp8 computes nn.Linear operators (their F.linear call) and a {type(module).__name__} is not one;"
                " assign it 'bf16'")
    if any(size % FP8_MULTIPLE for size in sizes):
        return (f"fp8 matmul kernels need in and out features that are multiples of {FP8_MULTIPLE}, and this"
                f" {type(module).__name__} has {sizes[0]} in, {sizes[1]} out; assign it 'bf16'")
    if device is not None:
        target = torch.device(device)
        if not device_class(target).runs(ComputePrecision.FP8):
            return (f"{target.type} device {device_class(target).describe()} has no fp8 matmul (torch._scaled_mm:"
                    " CUDA from sm89, or a CPU); assign it 'bf16'")
    return None
