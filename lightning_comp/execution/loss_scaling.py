"""Loss scaling for plans that use FP16: the scaler's life cycle, and a scaled optimizer step.

BF16 has FP32's exponent range and needs no loss scaling; FP16 does (``torch.amp.GradScaler``), and only pays where
the device has fast FP16 kernels (CUDA sm70+, CPUs with AMX-FP16).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim import LBFGS

from lightning_comp.adapters.lightning_internals import optimizer_handles_unscaling
from lightning_comp.adapters.torch_internals import grad_scaler_scale
from lightning_comp.errors import UnsupportedSetupError

__all__ = ["ScalerSlot", "SkippedSteps", "scaled_optimizer_step", "scaler_step"]


class ScalerSlot:
    """The loss scaler of a plugin: built for FP16 plans on the device the model computes on, dropped otherwise.

    Args:
        scaler: a user's own scaler (kept whatever the plan), or ``None`` for one made when needed.
        factory: makes a scaler for a device type (default ``torch.amp.GradScaler``; FSDP1 needs
            ``ShardedGradScaler``, whose overflow check spans every rank's gradient shard).
    """

    def __init__(self, scaler: torch.amp.GradScaler | None = None,
                 factory: Callable[[str], torch.amp.GradScaler] | None = None) -> None:
        self.scaler = scaler
        self.user_supplied = scaler is not None
        self._device: str | None = None
        self._factory = factory or (lambda device: torch.amp.GradScaler(device=device))

    def sync(self, uses_fp16: bool, device_type: str) -> None:
        """Have a scaler for ``device_type`` exactly when the plan uses FP16 (its state kept when the model moved)."""
        if uses_fp16:
            if self.scaler is None:
                self.scaler = self._factory(device_type)
            elif not self.user_supplied and self._device not in (None, device_type):
                moved = self._factory(device_type)
                state = self.scaler.state_dict()
                if state:
                    moved.load_state_dict(state)
                self.scaler = moved
            self._device = device_type
        elif not self.user_supplied:
            self.scaler = None
            self._device = None

    def load(self, state: Mapping[str, Any] | None, uses_fp16: bool, model_known: bool) -> None:
        """Restore a checkpoint's scaler state (made for the current device once the model is placed)."""
        if not state:
            return
        if self.scaler is None and not model_known and uses_fp16:
            self._device = "cuda" if torch.cuda.is_available() else "cpu"  # a guess: sync() moves it once placed
            self.scaler = self._factory(self._device)
        if self.scaler is not None:  # None: the plan in force has no fp16 (e.g. declined on this device)
            self.scaler.load_state_dict(dict(state))


class SkippedSteps:
    """How many optimizer steps the loss scaler skipped, counted where the scale lives.

    Whether a step was skipped is a comparison of the scale tensor before and after ``update()``; adding it up on the
    device keeps the host out of it: the count is read back (one sync) only when :attr:`value` is asked for (by a
    search at a trial's end, or a checkpoint), not at every step.
    """

    def __init__(self, value: int = 0) -> None:
        self._known = int(value)
        self._pending: torch.Tensor | None = None

    def add(self, skipped: torch.Tensor | bool) -> None:
        """Count one step: ``skipped`` is a bool, or a 0-d bool tensor on the scaler's device."""
        if isinstance(skipped, torch.Tensor):
            step = skipped.to(torch.int64)
            if self._pending is not None and self._pending.device == step.device:
                self._pending = self._pending + step
                return
            if self._pending is not None:  # the scaler moved to another device: settle what the old one counted
                self._known += int(self._pending.item())
            self._pending = step
            return
        self._known += int(skipped)

    @property
    def value(self) -> int:
        """The count (reads the device-side part back, once)."""
        if self._pending is not None:
            self._known += int(self._pending.item())
            self._pending = None
        return self._known


def scaled_optimizer_step(scaler: torch.amp.GradScaler, optimizer: Any, model: Any, closure: Callable[[], Any],
                          after_closure: Callable[[Any, Any], None],
                          **kwargs: Any) -> tuple[Any, torch.Tensor | bool]:
    """One optimizer step with loss scaling, as Lightning's ``MixedPrecision`` does it, and no host sync of its own:
    the only one is inside ``scaler.step`` (whether any gradient overflowed decides whether the step runs).

    Returns:
        The step's output, and whether the scaler skipped the step (its scale went down): a 0-d bool tensor on the
        scaler's device (read it when needed, e.g. through :class:`SkippedSteps`), or ``False`` when nothing was
        scaled.

    Raises:
        UnsupportedSetupError: for LBFGS, which re-evaluates the closure and cannot be loss-scaled.
    """
    _refuse_unscalable(optimizer)
    closure_result = closure()
    skip_unscaling = closure_result is None and model.automatic_optimization
    if not optimizer_handles_unscaling(optimizer) and not skip_unscaling:
        scaler.unscale_(optimizer)
    after_closure(model, optimizer)
    if skip_unscaling:
        return closure_result, False
    return scaler_step(scaler, optimizer, **kwargs)


def scaler_step(scaler: torch.amp.GradScaler, optimizer: Any, **kwargs: Any) -> tuple[Any, torch.Tensor | bool]:
    """Step ``optimizer`` through ``scaler`` (skipped if a gradient overflowed) and update the scale.

    Returns:
        The step's output, and whether the step was skipped (the scale went down): a 0-d bool tensor on the scaler's
        device, or ``False`` when the scaler has no scale yet.

    Raises:
        UnsupportedSetupError: for LBFGS, which re-evaluates the closure and cannot be loss-scaled.
    """
    _refuse_unscalable(optimizer)
    scale = grad_scaler_scale(scaler)
    before = None if scale is None else scale.clone()
    step_output = scaler.step(optimizer, **kwargs)
    scaler.update()
    after = grad_scaler_scale(scaler)  # update() writes the scale in place (or, given a new scale, may replace it)
    if before is None or after is None:
        return step_output, False
    return step_output, after < before


def _refuse_unscalable(optimizer: Any) -> None:
    if isinstance(optimizer, LBFGS):
        raise UnsupportedSetupError("Loss scaling for fp16 plans is not compatible with the LBFGS optimizer.")
