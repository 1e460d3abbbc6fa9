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
from lightning_comp.errors import UnsupportedSetupError

__all__ = ["ScalerSlot", "scaled_optimizer_step"]


class ScalerSlot:
    """The loss scaler of a plugin: built for FP16 plans on the device the model computes on, dropped otherwise.

    Args:
        scaler: a user's own scaler (kept whatever the plan), or ``None`` for one made when needed.
    """

    def __init__(self, scaler: torch.amp.GradScaler | None = None) -> None:
        self.scaler = scaler
        self.user_supplied = scaler is not None
        self._device: str | None = None

    def sync(self, uses_fp16: bool, device_type: str) -> None:
        """Have a scaler for ``device_type`` exactly when the plan uses FP16 (its state kept when the model moved)."""
        if uses_fp16:
            if self.scaler is None:
                self.scaler = torch.amp.GradScaler(device=device_type)
            elif not self.user_supplied and self._device not in (None, device_type):
                moved = torch.amp.GradScaler(device=device_type)
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
            self.scaler = torch.amp.GradScaler(device=self._device)
        if self.scaler is not None:  # None: the plan in force has no fp16 (e.g. declined on this device)
            self.scaler.load_state_dict(dict(state))


def scaled_optimizer_step(scaler: torch.amp.GradScaler, optimizer: Any, model: Any, closure: Callable[[], Any],
                          after_closure: Callable[[Any, Any], None], **kwargs: Any) -> tuple[Any, bool]:
    """One optimizer step with loss scaling, as Lightning's ``MixedPrecision`` does it.

    Returns:
        The step's output, and whether the scaler skipped the step (its scale went down).

    Raises:
        UnsupportedSetupError: for LBFGS, which re-evaluates the closure and cannot be loss-scaled.
    """
    if isinstance(optimizer, LBFGS):
        raise UnsupportedSetupError("Loss scaling for fp16 plans is not compatible with the LBFGS optimizer.")
    closure_result = closure()
    skip_unscaling = closure_result is None and model.automatic_optimization
    if not optimizer_handles_unscaling(optimizer) and not skip_unscaling:
        scaler.unscale_(optimizer)
    after_closure(model, optimizer)
    if skip_unscaling:
        return closure_result, False
    scale_before = scaler.get_scale()
    step_output = scaler.step(optimizer, **kwargs)
    scaler.update()
    return step_output, scaler.get_scale() < scale_before
