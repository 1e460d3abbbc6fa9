"""``CoMPFabricPrecision``: a Lightning Fabric precision plugin that trains with an operator-wise precision plan.

The search is a Trainer callback; a Fabric loop gets its plan from a file a Trainer search saved
(``CoMPSearch`` writes ``plan.json``; ``PrecisionPlan.save``), or a mapping of the user's own.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_comp.adapters.torch_internals import grad_scaler_scale
from lightning_comp.devices.device_classes import DeviceClass, device_class, model_device
from lightning_comp.errors import UnsupportedSetupError, UsageError
from lightning_comp.execution.compiled_regions import is_compiled
from lightning_comp.execution.emulation import check_plan_device, decline_slow_fp16
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.execution.loss_scaling import ScalerSlot, SkippedSteps
from lightning_comp.execution.optimizer_states import OptimizerStates
from lightning_comp.execution.plugin_state import PluginState
from lightning_comp.execution.saved_tensors import DEFAULT_MIN_SAVED_BYTES
from lightning_comp.execution.unplanned_work import UnplannedWorkWarnings
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.plan.plan import PlanLike, PrecisionPlan, plan_from_any

__all__ = ["CoMPFabricPrecision"]


class CoMPFabricPrecision(Precision):
    """Train a Fabric loop with a per-operator precision plan: FP32 master weights, each operator in its precision.

    Pass it as ``Fabric(plugins=[CoMPFabricPrecision(plan)])`` and leave Fabric's ``precision`` unset. The plan is put
    into effect with forward hooks on the module given to ``fabric.setup`` once it is on its device (its first
    forward); every forward of the module runs as a step of the kind its mode says (``train()``: training,
    ``eval()``: validation), the first of each kind tracing the model's own work
    (:mod:`lightning_comp.operators.owned_work`). FP16 plans scale the loss (``fabric.backward``) and step through
    the scaler (``optimizer.step()`` of the optimizer ``fabric.setup`` returned); BF16 plans need no scaling.

    **Checkpoints.** The plugin is stateful: put it into the state Fabric saves and loads, and the plan, the
    scaler's state and the step counters travel with the checkpoint::

        state = {"model": model, "optimizer": optimizer, "comp": plugin}
        fabric.save(path, state)
        fabric.load(path, state)  # puts the checkpoint's plan back, unless the plugin was given one

    Args:
        plan: a :class:`PrecisionPlan`, a ``{selector: precision}`` mapping, a path to a saved plan, or ``None``
            (all FP32, until a checkpoint's plan is loaded).
        allow_slow_fp16: keep FP16 entries on a device without fast FP16 (else they run in FP32, with a warning).
        scaler: a ``torch.amp.GradScaler`` for FP16 plans instead of a default one.
        recast_weights_in_backward: as :class:`~lightning_comp.CoMPPrecision`.
        min_saved_bytes: as :class:`~lightning_comp.CoMPPrecision`.

    Raises:
        PlanError: if ``plan`` cannot be read.
    """

    precision = "32-true"  # master weights and everything outside the plan's operators

    def __init__(self, plan: PlanLike = None, *, allow_slow_fp16: bool = False,
                 scaler: torch.amp.GradScaler | None = None, recast_weights_in_backward: bool = True,
                 min_saved_bytes: int = DEFAULT_MIN_SAVED_BYTES) -> None:
        self._requested = plan_from_any(plan)
        self._users_own = plan is not None
        self.allow_slow_fp16 = bool(allow_slow_fp16)
        self._scaler = ScalerSlot(scaler)
        self._executor = PlanExecutor(recast_weights_in_backward=recast_weights_in_backward,
                                      min_saved_bytes=min_saved_bytes)
        self._skipped = SkippedSteps()
        self._unplanned = UnplannedWorkWarnings()
        self._optimizer_states = OptimizerStates()
        self.optimizer_steps = 0

    # -------------------------------------------------------------------------------------------- the plan
    @property
    def plan(self) -> PrecisionPlan:
        """The plan in force (bound to the model once it ran), else the plan asked for."""
        applied = self._executor.plan
        return self._requested if applied is None else applied

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler (FP16 plans only, or the one passed to the constructor)."""
        return self._scaler.scaler

    @property
    def device(self) -> DeviceClass | None:
        """The class of the device the plan runs on (``None`` until the model's first forward)."""
        device = self._executor.device
        return None if device is None else device_class(device)

    @property
    def executor(self) -> PlanExecutor:
        """The hook engine (for inspection)."""
        return self._executor

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the FP16 loss scaler skipped so far (reading it is a host sync)."""
        return self._skipped.value

    def set_plan(self, plan: PlanLike) -> PrecisionPlan:
        """Replace the plan by one of the user's own (it then wins over a checkpoint's); re-hooks a placed model.

        Raises:
            PlanMismatchError: if the plan does not fit the model.
            PlanError: if an operator has no kernel for its planned precision on the model's device.
        """
        self._requested, self._users_own = plan_from_any(plan), True
        if self._executor.model is not None and self._executor.device is not None:
            self._apply()
        return self.plan

    def _apply(self) -> None:
        model = self._executor.model
        assert model is not None
        device = model_device(model)
        target = device_class(device)
        plan = self._executor.apply(model, decline_slow_fp16(self._requested, target, self.allow_slow_fp16), device)
        self._optimizer_states.assign(model, plan)
        self._scaler.sync(plan.uses(ComputePrecision.FP16), device.type)
        check_plan_device(plan, model, target, stacklevel=4,
                          accepted=frozenset({ComputePrecision.FP16}) if self.allow_slow_fp16 else frozenset())
        self._unplanned.check(self._executor, self._users_own, type(self).__name__)

    # ---------------------------------------------------------------------------------------- Fabric hooks
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Check the plan fits ``module`` and remember it; the hooks go on at its first forward, on its device.

        Raises:
            PlanMismatchError: if the plan does not fit ``module``.
            UsageError: if another module was set up with this plugin (a plugin holds one module's plan).
        """
        attached = self._executor.model
        if attached is not None and attached is not module:
            raise UsageError(
                f"CoMPFabricPrecision already holds the plan of a {type(attached).__name__}; setting up a second module"
                f" ({type(module).__name__}) with it would take the plan off the first. Set up one module per Fabric,"
                " or put both into one nn.Module."
            )
        self._requested.validate(module)
        self._executor.attach(module, compiled=is_compiled(module))
        return module

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        """The context of one forward of the module: a step of the plan (training or validation, by its mode)."""
        return self._step()

    @contextmanager
    def _step(self) -> Generator[None, None, None]:
        model = self._executor.model
        if model is None:
            raise UsageError("CoMPFabricPrecision: no module was set up; call fabric.setup(model, optimizer) first.")
        if not self._executor.placed():
            self._apply()  # the first forward, or the module moved
        with self._executor.step(StepKind.TRAIN if model.training else StepKind.VALIDATION):
            yield
        self._unplanned.check(self._executor, self._users_own, type(self).__name__)  # once the work is traced

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward of the (FP16 plans: scaled) loss, with forwards that activation checkpointing re-runs computing
        the step's own dtypes."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        with self._executor.recomputing():
            tensor.backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Step the optimizer; under an FP16 plan through the scaler (a step whose gradients overflowed is skipped
        and the scale backs off).

        Raises:
            UnsupportedSetupError: for LBFGS under an FP16 plan (it re-evaluates the loss: it cannot be scaled).
        """
        self.optimizer_steps += 1
        scaler = self.scaler
        states = self._optimizer_states
        if isinstance(optimizer, Optimizer):
            if scaler is None and states.steps(optimizer):  # the plan manages some of its parameters
                states.watch(optimizer)
                return states.step(optimizer, lambda: optimizer.step(**kwargs))
            states.convert(optimizer)  # moments a former plan kept in 8 bits or bf16: back to the optimizer's own
        if scaler is None:
            return optimizer.step(**kwargs)
        if isinstance(optimizer, LBFGS):
            raise UnsupportedSetupError("Loss scaling for fp16 plans is not compatible with the LBFGS optimizer.")
        scale = grad_scaler_scale(scaler)
        before = None if scale is None else scale.clone()
        output = scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        scaler.update()
        after = grad_scaler_scale(scaler)
        if before is not None and after is not None:
            self._skipped.add(after < before)
        return output

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale the gradients before clipping (``fabric.clip_gradients``) under an FP16 plan."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    # ------------------------------------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        """The plan (plain Python types), the scaler's state and the step counters, as ``CoMPPrecision`` keeps them
        (a Trainer checkpoint's ``CoMPPrecision`` state loads here, and back)."""
        return PluginState(plan=self.plan.to_dict(), scaler=None if self.scaler is None else self.scaler.state_dict(),
                           skipped_steps=self.skipped_steps, optimizer_steps=self.optimizer_steps,
                           rounding=self._optimizer_states.rounding_state() or None).to_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put the checkpoint's plan in force (unless the plugin was given one of the user's own), then the scaler
        and the counters.

        Raises:
            PlanError: if the state is malformed or of another version.
            PlanMismatchError: if the stored plan was made for a different model.
        """
        state = PluginState.from_dict(state_dict)
        if not self._users_own:
            self._requested = PrecisionPlan.from_dict(state.plan)
            if self._executor.model is not None:
                self._requested.validate(self._executor.model)
                if self._executor.device is not None:
                    self._apply()
        self._scaler.load(state.scaler, self.plan.uses(ComputePrecision.FP16), self._executor.device is not None)
        self._skipped = SkippedSteps(state.skipped_steps)
        self.optimizer_steps = state.optimizer_steps
        self._optimizer_states.load_rounding_state(state.rounding)

    @override
    def teardown(self) -> None:
        """Take the hooks off the model: it computes in FP32 afterwards (the plan stays inspectable)."""
        self._executor.detach()
        self._optimizer_states.release()  # bf16 masters back to the dtypes the model came with
