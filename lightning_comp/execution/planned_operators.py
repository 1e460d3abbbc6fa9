"""Each operator of a model as a plan hooks it: its planned precisions and the way they are put into effect.

:func:`hooked_operators` makes the :class:`~lightning_comp.execution.hooks.HookedOperator` of every operator a plan
applies to (and refuses, before any step runs, operators with no kernel for their planned precision on the device);
:func:`provisional_operators` makes those of the containers a tracing step hooks for one step, until the trace says
whether they compute anything themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_comp.devices.device_classes import device_class
from lightning_comp.devices.lowering import Lowering, autocast_available, lowering_for, why_not_lowerable
from lightning_comp.errors import PlanError
from lightning_comp.execution.hooks import HookedOperator
from lightning_comp.execution.parameter_groups import parameter_owners
from lightning_comp.operators.discovery import iter_operators, iter_untraced_containers
from lightning_comp.operators.kinds import OperatorKind, classify
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["hooked_operators", "provisional_operators"]


def hooked_operators(model: nn.Module, plan: PrecisionPlan, device: torch.device,
                      compiled: bool) -> dict[str, HookedOperator]:
    """Each operator of ``model`` with its planned precisions and the way they are put into effect on ``device`` (an
    FP32 operator that reads a parameter a ``master`` entry holds in bf16, its own or one tied to another operator's,
    computes with FP32 copies of such parameters).

    Raises:
        PlanError: naming every operator with no kernel for its planned precision there (and what each way of
            lowering it raised), or, for a compiled model, every operator that computes in fp8, saves in a lower
            precision or recomputes.
    """
    operators: dict[str, HookedOperator] = {}
    unsupported = []
    held_bf16 = _bf16_masters(model, plan)
    for name, module in iter_operators(model):
        precision = plan.of(Dimension.COMPUTE, name, type(module))
        lowering = lowering_for(module, precision, device)
        if lowering is None:
            why = why_not_lowerable(module, precision, device)
            unsupported.append(f"{name or '<root>'} ({type(module).__name__}, {precision.value}: {why})")
            continue
        kind = classify(module)
        # the parameters it reads itself (a container's children are operators of their own)
        reads_bf16 = any(id(p) in held_bf16 for p in module.parameters(recurse=kind is not OperatorKind.FUNCTIONAL))
        operators[name] = HookedOperator(name, module, kind, precision, lowering,
                                         saved=plan.of(Dimension.SAVED, name, type(module)),
                                         fp32_copies=lowering is Lowering.NONE and reads_bf16)
    if unsupported:
        raise PlanError(
            f"{len(unsupported)} operator(s) have no kernel for their planned precision on {device}"
            f" [{device_class(device).describe()}]: {'; '.join(unsupported)}. Assign them 'fp32' in the plan"
            " (e.g. {'<name>': 'fp32'}), or let CoMPSearch choose on this device."
        )
    fp8 = sorted(name or "<root>" for name, op in operators.items() if op.lowering is Lowering.FLOAT8)
    if compiled and fp8:
        raise PlanError(
            f"The plan computes {', '.join(fp8)} in fp8, which lightning-comp lowers in eager mode only (a"
            " TorchFunctionMode entered by the operator's hooks, which a compiled graph does not trace). Train the"
            " model uncompiled, or assign those operators 'bf16'.")
    changing = sorted(name or "<root>" for name, op in operators.items() if op.saved.changes)
    if compiled and changing:
        raise PlanError(
            f"The plan saves tensors for backward other than as computed ({', '.join(changing)}: in a lower"
            " precision, or recomputed), which torch.compile cannot trace: AOTAutograd decides what a compiled graph"
            " saves. Drop the plan's 'saved' entries for a compiled model (CoMPSearch(saved_precision='off')), or"
            " train it uncompiled."
        )
    return operators


def _bf16_masters(model: nn.Module, plan: PrecisionPlan) -> set[int]:
    """The ids of ``model``'s parameters that ``plan``'s ``master`` entries hold in bf16 (by each parameter's owning
    operator, :mod:`~lightning_comp.execution.parameter_groups`; the default for a parameter no operator owns). A
    parameter tied to several modules (an embedding and the output head) is one parameter, owned once."""
    held = set()
    for owned in parameter_owners(model):
        master = (plan.of(Dimension.MASTER, owned.owner, owned.owner_type) if owned.owner is not None
                  else plan[Dimension.MASTER].default)
        if master.managed:
            held.add(id(owned.parameter))
    return held


def provisional_operators(model: nn.Module, plan: PrecisionPlan, device: torch.device,
                           operators: dict[str, HookedOperator]) -> dict[str, HookedOperator]:
    """The containers of ``model`` not traced yet, hooked for one step as ``FUNCTIONAL`` operators in their planned
    precision (an autocast region; FP32 where the device has none); none if no container is planned low."""
    containers = [(n, m) for n, m in iter_untraced_containers(model) if n not in operators]
    precisions = {n: plan.of(Dimension.COMPUTE, n, type(m)) for n, m in containers}
    if not any(p.is_low for p in precisions.values()):
        return {}
    autocast = autocast_available(device.type)
    out = {}
    for name, module in containers:
        precision = precisions[name]
        lowering = Lowering.AUTOCAST if precision.is_low and autocast else Lowering.NONE
        out[name] = HookedOperator(name, module, OperatorKind.FUNCTIONAL, precision, lowering, provisional=True)
    return out
