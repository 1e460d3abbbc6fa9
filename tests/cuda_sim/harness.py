"""Run training steps of a plan on (simulated) CUDA through the plugin's own entry points, recording every op.

A whole ``Trainer(accelerator="gpu")`` does not get through a simulation (Lightning's data-loader seeding and length
checks read values back), so :func:`run_steps` drives what the Trainer drives: ``convert_module`` on the CPU model,
the move to the device, ``connect``, the train-step context around forward, the scaler's ``scale`` and the
plugin's ``backward`` context around backward, as ``CoMPPrecision`` is driven in training. The first step calibrates
cast boundaries, the second runs with them (the two differ in which outputs stay low).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_comp import CoMPPrecision
from lightning_comp.devices.lowering import Lowering, lowering_for
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.kinds import OperatorKind, classify
from tests.cuda_sim.cases import Case, loss_of
from tests.cuda_sim.recorder import CudaRecorder, CudaRuleViolation, OpEvent
from tests.cuda_sim.simulated import SimulatedGpu, cuda_tensors, simulated_gpu

__all__ = ["CUDA_AUTOCAST_FP32_WORK", "SimRun", "check_run", "run_steps"]

# work ops CUDA autocast runs in fp32 whatever the region's dtype (its fp32 list: layer_norm, group_norm, ...)
CUDA_AUTOCAST_FP32_WORK = frozenset({"native_layer_norm", "native_layer_norm_backward", "native_group_norm",
                                     "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward"})


@dataclass
class SimRun:
    """What the steps of a plan did on the device."""

    gpu: SimulatedGpu
    plugin: CoMPPrecision
    model: nn.Module
    recorder: CudaRecorder
    losses: list[torch.Tensor] = field(default_factory=list)
    grads: dict[str, tuple[torch.dtype, str]] = field(default_factory=dict)
    params: dict[str, tuple[torch.dtype, str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def precisions(self) -> dict[str, ComputePrecision]:
        return self.plugin.executor.precisions()

    def operators_of(self, type_name: str) -> list[str]:
        modules = dict(self.model.named_modules())
        return [n for n in self.precisions if type(modules[n]).__name__ == type_name]


@contextmanager
def _on_device(gpu: SimulatedGpu) -> Iterator[None]:
    with simulated_gpu(gpu), cuda_tensors(gpu):
        yield


def run_steps(gpu: SimulatedGpu, case: Case, plan: Any, *, steps: int = 2, min_saved_bytes: int = 0,
              on_event: Callable[[OpEvent], None] | None = None,
              after_connect: Callable[[CoMPPrecision, nn.Module], None] | None = None) -> SimRun:
    """``steps`` training steps of ``case``'s model under ``plan`` on ``gpu``; every op recorded and checked.

    Raises:
        CudaRuleViolation: at the first op a CUDA kernel would reject or that reads back to the host.
    """
    torch.manual_seed(0)
    model = case.build().train()
    batch = case.batch()
    plugin = CoMPPrecision(plan, min_saved_bytes=min_saved_bytes)
    with warnings.catch_warnings(record=True) as seen, _on_device(gpu):
        warnings.simplefilter("always")
        plugin.convert_module(model)
        model.to("cuda")
        plugin.connect(model, [], [])
        if after_connect is not None:
            after_connect(plugin, model)
        modules = dict(model.named_modules())
        recorder = CudaRecorder(model, {name: modules[name] for name in plugin.executor.precisions()}, on_event)
        run = SimRun(gpu, plugin, model, recorder)
        x = batch.to("cuda")
        try:
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                with recorder:
                    with plugin.train_step_context():
                        loss = loss_of(model(x))
                    scaled = plugin.scaler.scale(loss) if plugin.scaler is not None else loss
                    with plugin.executor.recomputing():
                        scaled.backward()
                run.losses.append(loss)
                # the first step traced the model: operators it found computing between their children own ops now
                recorder.watch({name: modules[name] for name in plugin.executor.precisions()})
        finally:
            recorder.detach()
        run.grads = {n: (p.grad.dtype, p.grad.device.type) for n, p in model.named_parameters() if p.grad is not None}
        run.params = {n: (p.dtype, p.device.type) for n, p in model.named_parameters()}
    run.warnings = [str(w.message) for w in seen]
    return run


def check_run(run: SimRun, case: Case, low: ComputePrecision) -> None:
    """Hold ``run`` to what training ``case`` under a plan that lowers its operators to ``low`` must show on CUDA.

    Raises:
        CudaRuleViolation: naming what differs.
    """
    problems: list[str] = []
    precisions = run.precisions
    modules = dict(run.model.named_modules())
    for type_name in case.types:
        names = run.operators_of(type_name)
        if not names:
            problems.append(f"no hooked operator of type {type_name}")
        for name in names:
            if precisions[name] is not low:
                problems.append(f"{name} ({type_name}) computes in {precisions[name].value}, planned {low.value}")
                continue
            problems.extend(_check_operator(run, name, classify(modules[name]), low))
    for name, (dtype, device) in run.params.items():
        if (dtype, device) != (torch.float32, "cuda"):
            problems.append(f"parameter {name} is {dtype} on {device} (master weights are fp32 on cuda)")
    for name in run.params:
        if name not in run.grads:
            problems.append(f"parameter {name} got no gradient")
        elif run.grads[name] != (torch.float32, "cuda"):
            problems.append(f"gradient of {name} is {run.grads[name][0]} on {run.grads[name][1]}")
    problems.extend(f"the loss is {loss.dtype}" for loss in run.losses if loss.dtype != torch.float32)
    # about the case's operator types (a model's other modules may truly do no 16-bit work: x-transformers' rotary
    # embedding computes its frequencies from an fp32 buffer, and is told so)
    problems.extend(f"warning: {w}" for w in run.warnings
                    if "had no effect" in w and any(f"({t})" in w for t in case.types))
    if problems:
        raise CudaRuleViolation(f"{case.name} on {run.gpu.label}, {low.value}:\n  " + "\n  ".join(problems))


def _check_operator(run: SimRun, name: str, kind: OperatorKind, low: ComputePrecision) -> list[str]:
    wanted = low.dtype
    if kind is OperatorKind.EMBEDDING:  # computed in fp32 (identical numerics), the output emitted low
        casts = [e for e in run.recorder.of(name, "forward", "_to_copy") if wanted in e.outputs]
        return [] if casts else [f"{name}: no output cast to {wanted}"]
    if kind not in (OperatorKind.COMPUTE, OperatorKind.NORM) and not _has_work(run, name):
        return []
    if kind is OperatorKind.NORM and not _has_work(run, name):
        # a norm torch decomposes here (RMSNorm: CUDA's fused kernel is not in a CPU build): what its kernel is fed
        return [f"{name}: called with {c.inputs} and parameters {dict(c.parameters)}, planned {wanted}"
                for c in run.recorder.calls if c.owner == name
                and set(c.inputs) | set(c.parameters.values()) != {wanted}]
    # inside an autocast region, ops on CUDA autocast's fp32 list compute in fp32: autocast's rule, not the plan's
    autocast = lowering_for(dict(run.model.named_modules())[name], low, "cuda") is Lowering.AUTOCAST
    problems = []
    for phase in ("forward", "backward"):
        work = run.recorder.work(name, phase)
        if not work:
            problems.append(f"{name}: no {phase} work recorded")
        for e in work:
            expected = torch.float32 if autocast and e.op in CUDA_AUTOCAST_FP32_WORK else wanted
            if e.computes_in != expected:
                problems.append(f"{name}: {e.describe()} computes in {e.computes_in}, expected {expected}")
    return problems


def _has_work(run: SimRun, name: str) -> bool:
    return bool(run.recorder.work(name, "forward"))
