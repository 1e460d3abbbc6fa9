"""The measured side of a memory budget: the peak of a step of the plan before and after the levers (and of AMP's
plan, for a fractional budget), and by how many bytes the plan's misses the budget.

A budget in bytes is what the job must fit in: judged by CUDA's reserved peak, or a CPU's live heap (everything in
the process). A fraction of AMP's step peak is judged by the two steps' tensor peaks
(:attr:`~lightning_comp.search.measurement.process_memory.StepPeak.tensor_bytes`), so what the search's accounting
leaves out (temporaries, recomputed activations, casts) counts on both sides; where AMP's plan was not timed it is a
fraction of the plan's before the levers, as the accounting's target is.

The search's step is a forward and backward on the run's own weights and optimizer state (no update), so a plan's
optimizer-state formats are not in what it measures: the bytes they free (each managed parameter's state now, less
its format's size, :func:`~lightning_comp.execution.adam_step.state_nbytes`) are taken off the plan's measured peak
(:func:`state_not_in_step`). The update's own temporaries are in neither figure; bf16 masters are (the measured step
puts them in force).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch
from torch import nn

from lightning_comp.devices.device_classes import model_device
from lightning_comp.execution.adam_step import state_nbytes
from lightning_comp.execution.parameter_groups import parameter_owners
from lightning_comp.numerics.precision import StatePrecision
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.decisions.cheapest_bytes import MemorySpending
from lightning_comp.search.measurement.process_memory import StepPeak, held_tensor_bytes
from lightning_comp.search.measurement.step_timing import StepTimer
from lightning_comp.search.stages.context import StageContext

__all__ = ["measure_excess", "state_not_in_step"]


def state_not_in_step(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer],
                      state: Mapping[str, StatePrecision]) -> int:
    """Bytes of optimizer state that ``state`` (operator -> format) frees and a measured step does not: for each
    parameter of an operator with a managed format, the state it holds now less the format's size (never below 0)."""
    optimizers = list(optimizers)
    amsgrad = any(group.get("amsgrad", False) for optimizer in optimizers for group in optimizer.param_groups)
    total = 0
    for owned in parameter_owners(model):
        precision = state.get(owned.owner) if owned.owner is not None else None
        if precision is None or not precision.managed:
            continue
        held = sum(value.nbytes for optimizer in optimizers
                   for value in optimizer.state.get(owned.parameter, {}).values() if isinstance(value, torch.Tensor))
        total += max(held - state_nbytes(owned.parameter, precision, amsgrad), 0)
    return total


def measure_excess(ctx: StageContext, spending: MemorySpending, base: PrecisionPlan, plan: PrecisionPlan,
                   amp_plan: PrecisionPlan | None, state: Mapping[str, StatePrecision]) -> float:
    """Measure one step's peak of ``base`` (``"start"``), ``plan`` (the levers taken, whose optimizer-state formats
    are ``state``) and, for a fractional budget, ``amp_plan`` (``None``: not timed), into ``spending``; return by how
    many bytes the plan's peak misses the budget (0: met, not measurable here, or no budget; see the module
    docstring). Nothing is measured where no lever was taken and no budget is set."""
    budget = ctx.config.memory_budget
    limit = float(budget) if isinstance(budget, int) and not isinstance(budget, bool) else None
    fraction = float(budget) if isinstance(budget, float) else None
    if not (spending.selection.chosen or budget is not None):
        return 0.0
    plans = {"start": base, "plan": plan}
    if fraction is not None and amp_plan is not None:
        plans["amp"] = amp_plan
    reference = "amp" if "amp" in plans else "start"  # what a fraction is of
    model, optimizers = ctx.pl_module, ctx.trainer.optimizers
    timer = StepTimer(ctx.clock, 1, 0)
    peaks = timer.step_peaks({label: ctx.measured(p) for label, p in plans.items()}, ctx.step, model_device(model),
                             held=lambda: held_tensor_bytes(model, optimizers))
    ctx.plugin.try_plan(base)  # the masters back in fp32 before anything else runs
    peaks["plan"] = _less(peaks["plan"], state_not_in_step(model, optimizers, state))
    spending.process_peaks = ctx.agree(peaks)
    peak = spending.process_peaks["plan"]
    if limit is not None:
        needed = peak.reserved_bytes if peak.reserved_bytes is not None else peak.live_bytes
    elif fraction is not None:
        whole = spending.process_peaks[reference].tensor_bytes
        needed, limit = peak.tensor_bytes, None if whole is None else fraction * whole
    else:
        needed = None
    if limit is None or needed is None:
        return 0.0
    spending.process_limit_bytes = limit
    spending.process_reference = None if fraction is None else reference
    excess = float(ctx.agree(max(needed - limit, 0.0)))
    spending.process_met = excess == 0
    return excess


def _less(peak: StepPeak, nbytes: int) -> StepPeak:
    """``peak`` without ``nbytes`` of optimizer state that the plan frees and its measured step held: off every figure
    that counted it (the CPU's live heap and what the step starts with; CUDA's allocated and reserved peaks, the state
    being on the device); the OS peak is left as measured."""
    if nbytes <= 0:
        return peak

    def minus(value: int | None) -> int | None:
        return None if value is None else value - nbytes

    return replace(peak, live_bytes=minus(peak.live_bytes), held_bytes=minus(peak.held_bytes),
                   reserved_bytes=minus(peak.reserved_bytes), allocated_bytes=minus(peak.allocated_bytes),
                   how=f"{peak.how}; less {nbytes / 2**20:.2f} MiB of optimizer state the plan's formats free (the"
                       " measured step holds the run's own)")
