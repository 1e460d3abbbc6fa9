"""``PlanShell``: what every plugin of the package shows its user, each member a delegation to its ``PlanRuntime``.

A plugin class derives from :class:`PlanShell` first and from its framework's precision plugin second, builds its
:class:`~lightning_comp.plugins.runtime.PlanRuntime` as ``self._runtime``, and maps its framework's hooks onto it.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_comp.devices.device_classes import DeviceClass
from lightning_comp.execution.executor import PlanExecutor
from lightning_comp.plan.plan import PlanLike, PrecisionPlan
from lightning_comp.plugins.runtime import PlanOrigin, PlanRuntime
from lightning_comp.plugins.summary import plan_hyperparameters, precision_label

__all__ = ["PlanShell"]


class PlanShell:
    """The plan, its loss scaler, device and counters, ``set_plan`` and the checkpoint state of a plugin."""

    _runtime: PlanRuntime

    @property
    def plan(self) -> PrecisionPlan:
        """The plan in force (bound to the model once it is hooked), else the plan asked for."""
        return self._runtime.plan

    @property
    def precision_label(self) -> str:
        """What the run computes in: ``"comp-mixed"`` where the plan in force changes anything from FP32 training,
        else ``"32-true"``. (The ``precision`` attribute, which ``Trainer.precision`` reports, stays Lightning's
        literal ``"32-true"``, the master weights' precision: see :mod:`lightning_comp.plugins.summary`.)"""
        return precision_label(self.plan)

    def plan_hyperparameters(self) -> dict[str, Any]:
        """The plan in force as flat hyperparameters for a logger (``comp/precision``, ``comp/plan/<selector>``,
        operator counts, device class, fingerprints; :func:`lightning_comp.plugins.summary.plan_hyperparameters`)."""
        runtime = self._runtime
        hooked = runtime.executor.model is not None and runtime.executor.device is not None
        return plan_hyperparameters(self.plan, runtime.executor.precisions() if hooked else None, runtime.device)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler (FP16 plans only, or the one passed to the constructor)."""
        return self._runtime.scaler

    @property
    def device(self) -> DeviceClass | None:
        """The class of the device the plan runs (or last ran) on (``None`` until the model is placed and hooked)."""
        return self._runtime.device

    @property
    def compiled(self) -> bool:
        """Whether the model runs under ``torch.compile`` (known once the model is set up)."""
        return self._runtime.executor.compiled

    @property
    def executor(self) -> PlanExecutor:
        """The hook engine (for inspection)."""
        return self._runtime.executor

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the FP16 loss scaler skipped so far (counted on the device: reading it is a host sync)."""
        return self._runtime.skipped_steps

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far (a checkpoint's count included)."""
        return self._runtime.optimizer_steps

    @property
    def allow_slow_fp16(self) -> bool:
        """Whether FP16 entries are kept on a device without fast FP16 (read at the next hooking of the model)."""
        return self._runtime.allow_slow_fp16

    @allow_slow_fp16.setter
    def allow_slow_fp16(self, value: bool) -> None:
        self._runtime.allow_slow_fp16 = bool(value)

    def set_plan(self, plan: PlanLike) -> PrecisionPlan:
        """Replace the plan by one of the user's own; re-hooks the model at once if it is placed (idempotent).

        A plan set here wins over a checkpoint's on resume, like the constructor's.

        Args:
            plan: the new plan (anything the constructor accepts).

        Returns:
            The plan now in force.

        Raises:
            PlanMismatchError: if the plan does not fit the model.
            PlanError: if an operator has no kernel for its planned precision on the model's device.
        """
        return self._runtime.request(plan, PlanOrigin.USER)

    def state_dict(self) -> dict[str, Any]:
        """The plan (plain Python types, loadable with ``weights_only=True``), scaler state and step counters; the
        same for every plugin of the package (a Trainer checkpoint's state loads under Fabric, and back)."""
        return self._runtime.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the plan and re-apply it to the model (unless the user gave a plan of their own: it wins, with a
        warning naming what the checkpoint held), then the scaler and the step counters.

        Raises:
            PlanError: if the state is malformed, of another version, or has unknown keys.
            PlanMismatchError: if the stored plan was made for a different model.
        """
        self._runtime.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(plan={self.plan!r}, allow_slow_fp16={self.allow_slow_fp16},"
                f" recast_weights_in_backward={self.executor.recast_weights_in_backward})")
