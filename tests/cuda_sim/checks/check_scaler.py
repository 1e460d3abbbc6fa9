"""The fp16 loss scaler's control flow on ``GradScaler("cuda")``: skipped overflowing steps, backoff, growth, no host
sync of the package's own, and its state across a move.

``scale``/``unscale_``/``update`` run on fake tensors, but ``step`` must read whether a gradient overflowed, which a
fake tensor cannot answer: so these run with the availability patches and *real CPU tensors* (the whole
``GradScaler("cuda")`` logic then runs), and on the real device with CUDA tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_comp.execution.loss_scaling import ScalerSlot, SkippedSteps, scaled_optimizer_step
from tests.cuda_sim.simulated import SimulatedGpu, simulated_gpu


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func.overloadpacket.__name__ == "_local_scalar_dense"
        return func(*args, **(kwargs or {}))


class _Module:
    automatic_optimization = True


def _device(gpu: SimulatedGpu) -> str:
    return "cpu" if gpu.simulated else "cuda"


def _step(scaler: torch.amp.GradScaler, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
          overflow: bool) -> tuple[Any, torch.Tensor | bool]:
    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).sum() * (math.inf if overflow else 1.0)
        scaler.scale(loss).backward()
        return loss

    return scaled_optimizer_step(scaler, optimizer, _Module(), closure, lambda module, opt: None)


def test_overflowing_steps_are_skipped_the_scale_backs_off_and_grows(gpu: SimulatedGpu) -> None:
    with simulated_gpu(gpu):
        device = _device(gpu)
        torch.manual_seed(0)
        model = nn.Linear(4, 1).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 4, device=device)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
        assert scaler.is_enabled(), "GradScaler('cuda') switched itself off"
        skipped = SkippedSteps()
        before = model.weight.detach().clone()
        _, was_skipped = _step(scaler, model, optimizer, x, overflow=True)
        skipped.add(was_skipped)
        assert torch.equal(model.weight.detach(), before), "an overflowing step must not change the weights"
        assert scaler.get_scale() == 2.0**9 and skipped.value == 1
        for _ in range(2):
            _, was_skipped = _step(scaler, model, optimizer, x, overflow=False)
            skipped.add(was_skipped)
        assert not torch.equal(model.weight.detach(), before)
        assert scaler.get_scale() == 2.0**10, "two good steps (growth_interval=2) double the scale"
        assert skipped.value == 1


def test_a_scaled_step_reads_nothing_back_but_what_scaler_step_must(gpu: SimulatedGpu) -> None:
    """``scaler.step`` reads whether a gradient overflowed (one read per device); the package adds none (it once read
    ``get_scale()`` before and after every step: two more host syncs)."""
    with simulated_gpu(gpu):
        device = _device(gpu)
        model = nn.Linear(4, 1).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 4, device=device)
        scaler = torch.amp.GradScaler("cuda")
        _step(scaler, model, optimizer, x, overflow=False)  # the scaler's state exists from here on
        for overflow in (False, True):
            reads = _HostReads()
            with reads:
                _, was_skipped = _step(scaler, model, optimizer, x, overflow=overflow)
            assert reads.count == 1, f"{reads.count} host reads in one scaled optimizer step"
            assert isinstance(was_skipped, torch.Tensor) and bool(was_skipped) is overflow


def test_the_scaler_keeps_its_state_when_the_model_moves_to_cuda(gpu: SimulatedGpu) -> None:
    with simulated_gpu(gpu):
        slot = ScalerSlot()
        slot.sync(True, "cpu")
        assert slot.scaler is not None
        slot.scaler.load_state_dict({**slot.scaler.state_dict(), "scale": 256.0, "_growth_tracker": 5})
        slot.sync(True, "cuda")
        assert slot.scaler._device == "cuda"  # noqa: SLF001
        state = slot.scaler.state_dict()
        assert state["scale"] == 256.0 and state["_growth_tracker"] == 5
        slot.sync(False, "cuda")
        assert slot.scaler is None, "a plan without fp16 drops the scaler"
