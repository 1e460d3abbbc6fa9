"""Negative controls: defects put in on purpose, each of which the simulation must catch.

- a CPU lowering forced onto CUDA (LayerNorm by an input cast: bf16 input, fp32 weight, which CUDA's kernel refuses);
- an ``.item()`` added to an operator's hook (a host sync in forward);
- an operator left in fp32 by a plan that lowers it (its hook enters nothing, yet the executor reports it low).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_comp.devices import lowering as lowering_module
from lightning_comp.devices.lowering import Lowering
from lightning_comp.execution import hooks as hooks_module
from lightning_comp.execution import planned_operators
from lightning_comp.numerics.precision import ComputePrecision
from tests.cuda_sim.cases import CASES
from tests.cuda_sim.harness import check_run, run_steps
from tests.cuda_sim.recorder import CudaRuleViolation
from tests.cuda_sim.simulated import SimulatedGpu

LAYER_NORM = next(c for c in CASES if c.name == "LayerNorm")
LINEAR = next(c for c in CASES if c.name == "Linear")


def test_a_cpu_lowering_forced_onto_cuda_is_caught(gpu: SimulatedGpu, monkeypatch: pytest.MonkeyPatch) -> None:
    original = lowering_module.lowering_for

    def cpu_rules(module: nn.Module, precision: ComputePrecision, device: Any) -> Lowering | None:
        if isinstance(module, nn.LayerNorm) and precision is not ComputePrecision.FP32:
            return Lowering.INPUT  # what a CPU gets: its kernels take a 16-bit input with fp32 weights
        return original(module, precision, device)

    monkeypatch.setattr(planned_operators, "lowering_for", cpu_rules)  # where the executor decides lowerings
    run_steps(gpu, LAYER_NORM, {"*": "fp32"}, steps=1)  # the control itself runs where nothing is lowered
    with pytest.raises(CudaRuleViolation, match=r"share a dtype.*native_layer_norm\(input=bfloat16, weight=float32"):
        run_steps(gpu, LAYER_NORM, {"*": "bf16"})


def test_a_host_read_in_a_hook_is_caught(gpu: SimulatedGpu) -> None:
    def read_back(plugin: Any, model: nn.Module) -> None:
        model.body[0].register_forward_pre_hook(lambda module, args: float(args[0].abs().max().item()))

    with pytest.raises(CudaRuleViolation, match=r"device-to-host read \(_local_scalar_dense\) in forward of body.0"):
        run_steps(gpu, LINEAR, {"*": "bf16"}, after_connect=read_back)


def test_an_operator_left_in_fp32_by_a_plan_that_lowers_it_is_caught(gpu: SimulatedGpu,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    original = hooks_module._enter  # noqa: SLF001

    def enter_nothing_for_the_head(op: Any, contexts: Any) -> None:
        if op.name != "head":  # the head's regions and weight casts are never entered
            original(op, contexts)

    monkeypatch.setattr(hooks_module, "_enter", enter_nothing_for_the_head)
    run = run_steps(gpu, LINEAR, {"head": "bf16"})  # (with its input chained low, mixed operands are caught earlier)
    assert run.precisions["head"] is ComputePrecision.BF16  # the executor believes it is lowered
    with pytest.raises(CudaRuleViolation, match=r"head: forward addmm\(.*\) in head computes in torch.float32"):
        check_run(run, LINEAR, ComputePrecision.BF16)
    assert torch.float32 in {e.computes_in for e in run.recorder.work("head", "forward")}
