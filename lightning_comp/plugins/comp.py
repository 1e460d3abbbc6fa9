"""``CoMPPrecision``: a Lightning precision plugin that trains with an operator-wise precision plan."""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_comp.adapters.lightning_internals import compiled, optimizer_handles_unscaling
from lightning_comp.devices.device_class import DeviceClass, device_class, model_device
from lightning_comp.errors import UnsupportedSetupError
from lightning_comp.execution.compiled_regions import guarding_hooks
from lightning_comp.execution.emulation import check_plan_device
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.execution.loss_scaling import (
    PLUGIN_STATE_VERSION,
    ScalerSlot,
    check_plugin_state,
    decline_slow_fp16,
    scaled_optimizer_step,
)
from lightning_comp.execution.saved_tensors import DEFAULT_MIN_SAVED_BYTES
from lightning_comp.numerics.precision import Precision as Dtype
from lightning_comp.plan.plan import PrecisionPlan, plan_from_any

__all__ = ["CoMPPrecision"]

PlanLike = PrecisionPlan | Mapping[str, Any] | str | os.PathLike[str] | None


class CoMPPrecision(Precision):
    """Train with a per-operator precision plan: FP32 master weights, each operator in its own precision.

    Pass it to the Trainer as ``Trainer(plugins=[CoMPPrecision(plan)])`` and leave the Trainer's ``precision``
    unset. The plan is put into effect with forward hooks once the Trainer has placed the model on its device, so
    the model's code is unchanged. Everything device-dependent (autocast device, each operator's lowering, the loss
    scaler's device) follows the device the model computes on, and is rebuilt if the model moves. Parameters,
    gradients and optimizer state stay FP32. A plan that uses FP16 anywhere turns on dynamic loss scaling
    (``torch.amp.GradScaler``); BF16-only plans need none. A plan whose 16-bit precision is emulated on this device
    (BF16 on an AVX2-only CPU) still trains, with a warning naming the operators.

    Args:
        plan: a :class:`PrecisionPlan`, a ``{selector: precision}`` mapping, a path to a plan saved with
            :meth:`PrecisionPlan.save`, or ``None`` for all-FP32 until a :class:`~lightning_comp.CoMPSearch` sets one.
        allow_slow_fp16: FP16 entries on a device without fast FP16 (e.g. a CPU without AMX-FP16, where FP16
            convolution backward runs a reference kernel ~100x slower than FP32) are replaced by FP32 with a
            warning, unless this is ``True``.
        scaler: a ``torch.amp.GradScaler`` to use for FP16 plans instead of a default one.
        recast_weights_in_backward: lowered ``Linear``/``Conv`` (and parameter-copy) operators save a recipe for
            backward instead of their 16-bit weight copy, and backward casts the FP32 master again: 2 bytes per
            lowered parameter less memory held through forward, for one extra cast per weight and step. Gradients
            are bit-identical either way. ``False`` keeps the copies (autocast's behaviour).
        min_saved_bytes: operators whose plan entry saves ``bf16``/``fp8`` for backward store tensors smaller than
            this many bytes as they are (their pack and unpack cost more than the bytes they would save).

    Raises:
        PlanError: if ``plan`` cannot be read.
    """

    precision = "32-true"  # master weights and everything outside the plan's operators; keeps Lightning's literal

    def __init__(
        self,
        plan: PlanLike = None,
        *,
        allow_slow_fp16: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        recast_weights_in_backward: bool = True,
        min_saved_bytes: int = DEFAULT_MIN_SAVED_BYTES,
    ) -> None:
        super().__init__()
        self._requested: PrecisionPlan = plan_from_any(plan)
        self._plan: PrecisionPlan = self._requested
        self.allow_slow_fp16 = bool(allow_slow_fp16)
        self._scaler = ScalerSlot(scaler)
        self._executor = PlanExecutor(recast_weights_in_backward=recast_weights_in_backward,
                                      min_saved_bytes=min_saved_bytes)
        self._model: nn.Module | None = None
        self._placed: torch.device | None = None  # the device the hooks and the scaler were built for
        self._compiled = False  # the model runs under torch.compile
        self._hook_guards = ExitStack()  # while a compiled model trains: Dynamo guards on hooks
        self._check_device = True
        self.skipped_steps = 0
        self.optimizer_steps = 0

    # -------------------------------------------------------------------------------------------- the plan
    @property
    def plan(self) -> PrecisionPlan:
        """The plan in force (bound to the model once the Trainer has set it up)."""
        return self._plan

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler (FP16 plans only, or the one passed to the constructor)."""
        return self._scaler.scaler

    @property
    def device(self) -> DeviceClass | None:
        """The class of the device the plan runs (or last ran) on (``None`` until the model is placed and hooked)."""
        device = self._executor.device
        return None if device is None else device_class(device)

    @property
    def compiled(self) -> bool:
        """Whether the model runs under ``torch.compile`` (known once the Trainer has set it up)."""
        return self._compiled

    @property
    def executor(self) -> PlanExecutor:
        """The hook engine (for inspection)."""
        return self._executor

    def set_plan(self, plan: PlanLike, *, check_device: bool = True) -> PrecisionPlan:
        """Replace the plan; re-hooks the model at once if it is known (idempotent, no stale or double hooks).

        Args:
            plan: the new plan (anything the constructor accepts).
            check_device: warn if the plan's 16-bit precision is emulated on the model's device (the search turns
                this off for the trial plans it makes on purpose).

        Returns:
            The plan now in force.

        Raises:
            PlanMismatchError: if the plan does not fit the model.
            PlanError: if an operator has no kernel for its planned precision on the model's device.
        """
        requested = plan_from_any(plan)
        previous, self._requested = self._requested, requested
        self._check_device = check_device
        if self._model is not None:
            try:
                self._apply()
            except Exception:
                self._requested = previous  # a rejected plan must not poison the next fit's convert_module
                raise
        else:
            self._plan = self._requested
        return self._plan

    def _apply(self) -> None:
        """Hook the model for the device it is on now (its parameters' device, read now, never remembered)."""
        assert self._model is not None
        device = model_device(self._model)
        target = device_class(device)
        plan = decline_slow_fp16(self._requested, target, self.allow_slow_fp16)
        self._plan = self._executor.apply(self._model, plan, device, compiled=self._compiled)
        self._placed = device
        self._scaler.sync(self._plan.uses(Dtype.FP16), device.type)
        if self._check_device:
            accepted = frozenset({Dtype.FP16}) if self.allow_slow_fp16 else frozenset()
            check_plan_device(self._plan, self._model, target, stacklevel=4, accepted=accepted)
        if not self._plan.is_all_fp32 and not self._plan.low_operators(self._model):
            rank_zero_warn(
                f"The plan {self._plan!r} assigns a 16-bit precision but lowers no operator of"
                f" {type(self._model).__name__} (its entries match only shape-only operators, or the model has no"
                " operator low precision applies to): training runs in fp32.",
                stacklevel=3,
            )

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(plan={self._plan!r}, allow_slow_fp16={self.allow_slow_fp16},"
                f" recast_weights_in_backward={self._executor.recast_weights_in_backward})")

    def _ensure_placed(self) -> None:
        """Re-hook if the model computes somewhere else than the hooks were built for (Lightning moved it)."""
        if self._model is not None and model_device(self._model) != self._placed:
            self._apply()

    # ------------------------------------------------------------------------------------------ Lightning hooks
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Check the plan fits ``module`` and remember it; the hooks go on once it is placed (:meth:`connect`).

        Lightning calls this *before* it moves the model to its device, so nothing device-dependent is decided here.
        ``module`` is returned unchanged (DDP ignores the return value: nothing is wrapped). A model compiled with
        ``torch.compile`` (before ``fit``, or a submodule in ``configure_model``) gets hooks that Dynamo traces into its
        graphs (see :mod:`lightning_comp.execution.compiled_regions`).

        Raises:
            PlanMismatchError: if the plan does not fit ``module``.
        """
        self._requested.validate(module)
        self._compiled = compiled(module)
        self._hook_guards.close()
        if self._compiled:
            self._hook_guards.enter_context(guarding_hooks())
        self._model = module
        self._placed = None
        return module

    @override
    def connect(self, model: Any, optimizers: Any, lr_schedulers: Any) -> Any:
        if type(model).__name__ == "DeepSpeedEngine":
            raise UnsupportedSetupError(
                "CoMPPrecision cannot drive a DeepSpeed engine (backward and step must go through DeepSpeed's own"
                " precision plugin). Use strategy='ddp' or 'auto' with CoMPPrecision, or DeepSpeed without it."
            )
        if self._model is not None:
            self._apply()  # Lightning has placed the model by now: hook it for its device
        return super().connect(model, optimizers, lr_schedulers)

    @contextmanager
    def _step(self, kind: StepKind) -> Generator[None, None, None]:
        self._ensure_placed()
        with self._executor.step(kind):
            yield

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with self._step(StepKind.TRAIN):
            yield

    @override
    @contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        with self._step(StepKind.VALIDATION):
            yield

    @override
    @contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        with self._step(StepKind.TEST):
            yield

    @override
    @contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        with self._step(StepKind.PREDICT):
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any,  # type: ignore[override]
                 **kwargs: Any) -> None:
        """Backward as the base plugin does it, with forwards that activation checkpointing re-runs in it computing
        the dtypes of the step's own forward."""
        with self._executor.recomputing():
            super().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        self.optimizer_steps += 1
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        output, skipped = scaled_optimizer_step(self.scaler, optimizer, model, closure, self._after_closure, **kwargs)
        self.skipped_steps += int(skipped)
        return output

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and self.scaler is not None and optimizer_handles_unscaling(optimizer):
            raise UnsupportedSetupError(
                f"{type(optimizer).__qualname__} unscales gradients internally (a 'fused' optimizer), so gradients"
                " cannot be clipped under an fp16 plan. Use a non-fused optimizer or a bf16 plan."
            )
        super().clip_gradients(optimizer=optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    # ------------------------------------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        """The plan (plain Python types, loadable with ``weights_only=True``), scaler state and step counters."""
        return {
            "version": PLUGIN_STATE_VERSION,
            "plan": self._plan.to_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "optimizer_steps": self.optimizer_steps,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the plan and re-apply it to the model, then restore the scaler.

        Raises:
            PlanError: if the state is malformed, of another version, or has unknown keys.
            PlanMismatchError: if the stored plan was made for a different model.
        """
        check_plugin_state(state_dict)
        self.set_plan(PrecisionPlan.from_dict(state_dict["plan"]))
        self._scaler.load(state_dict.get("scaler"), self._plan.uses(Dtype.FP16), self._model is not None)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.optimizer_steps = int(state_dict.get("optimizer_steps", 0))

    @override
    def teardown(self) -> None:
        """Take the hooks off the model at the end of every fit/validate/test/predict.

        The model the user gets back computes in FP32 and is safe to deep-copy (EMA, teacher models); the plan stays
        inspectable (:attr:`plan`, ``executor.precisions()``) and the next stage, or :meth:`set_plan`, hooks it again.
        """
        self._executor.detach()
        self._placed = None
        self._hook_guards.close()
        super().teardown()

    def _set_search_plan(self, plan: PlanLike) -> PrecisionPlan:
        """:meth:`set_plan` for the search's own trial plans (no emulation warning: the search chose to try them)."""
        return self.set_plan(plan, check_device=False)

    def remove_hooks(self) -> None:
        """Take the plan off the model (it then computes in FP32 everywhere); :meth:`set_plan` puts one back."""
        self._executor.remove()
