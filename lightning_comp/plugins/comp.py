"""``CoMPPrecision``: a Lightning precision plugin that trains with an operator-wise precision plan."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_comp.adapters.lightning_internals import optimizer_handles_unscaling
from lightning_comp.devices.device_classes import DeviceClass, device_class, model_device
from lightning_comp.errors import UnsupportedSetupError
from lightning_comp.execution.compiled_regions import guarding_hooks, is_compiled
from lightning_comp.execution.emulation import check_plan_device, decline_slow_fp16
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.execution.loss_scaling import ScalerSlot, SkippedSteps, scaled_optimizer_step
from lightning_comp.execution.optimizer_states import OptimizerStates
from lightning_comp.execution.plugin_state import CHECKPOINT_KEY, LEGACY_CHECKPOINT_KEYS, PluginState
from lightning_comp.execution.saved_tensors import DEFAULT_MIN_SAVED_BYTES
from lightning_comp.execution.unplanned_work import UnplannedWorkWarnings
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.plan.plan import PlanLike, PrecisionPlan, plan_from_any

__all__ = ["CoMPPrecision"]


class CoMPPrecision(Precision):
    """Train with a per-operator precision plan: FP32 master weights, each operator in its own precision.

    Pass it to the Trainer as ``Trainer(plugins=[CoMPPrecision(plan)])`` and leave the Trainer's ``precision``
    unset. The plan is put into effect with forward hooks once the Trainer has placed the model on its device, so
    the model's code is unchanged. Everything device-dependent (autocast device, each operator's lowering, the loss
    scaler's device) follows the device the model computes on, and is rebuilt if the model moves. Parameters,
    gradients and optimizer state stay FP32 unless the plan's ``state``/``master`` entries say otherwise (8-bit or
    BF16 Adam moments, BF16 master weights; :mod:`lightning_comp.execution.optimizer_states`). A plan that uses FP16
    anywhere turns on dynamic loss scaling
    (``torch.amp.GradScaler``); BF16-only plans need none. A plan whose 16-bit precision is emulated on this device
    (BF16 on an AVX2-only CPU) still trains, with a warning naming the operators.

    **Resuming.** ``fit(ckpt_path=...)`` puts the checkpoint's plan back, unless this plugin was given a plan of the
    user's own (in the constructor, or by :meth:`set_plan`): that plan wins, with a warning naming what the checkpoint
    held. A plan a search put in force (:meth:`try_plan`) gives way to the checkpoint's, from which the search resumes.

    **A search's entry points.** :meth:`try_plan` puts a plan in force that the caller tries on purpose;
    :meth:`measured_step` runs a training step of a plan outside Lightning's loop exactly as training would run it.
    ``CoMPSearch`` drives the plugin through these two only.

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
        ConfigError: if ``min_saved_bytes`` is not an integer >= 0.
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
        Precision.__init__(self)  # (not super(): a subclass that is also an FSDPPrecision must not run its __init__)
        self._requested: PrecisionPlan = plan_from_any(plan)  # asked for; the executor holds it bound, in force
        self._users_own = plan is not None  # the user's own plan wins over a checkpoint's
        self._trial = False  # the plan was put in force by try_plan (no emulation warning)
        self.allow_slow_fp16 = bool(allow_slow_fp16)
        self._scaler = ScalerSlot(scaler, self._new_scaler)
        self._executor = PlanExecutor(recast_weights_in_backward=recast_weights_in_backward,
                                      min_saved_bytes=min_saved_bytes)
        self._hook_guards = ExitStack()  # while a compiled model trains: Dynamo guards on hooks
        self._skipped = SkippedSteps()
        self._unplanned = UnplannedWorkWarnings()
        self._optimizer_states = OptimizerStates()
        self.optimizer_steps = 0

    def _new_scaler(self, device_type: str) -> torch.amp.GradScaler:
        """The loss scaler an FP16 plan gets on ``device_type`` (a strategy's plugin may need another kind)."""
        return torch.amp.GradScaler(device=device_type)

    # -------------------------------------------------------------------------------------------- the plan
    @property
    def plan(self) -> PrecisionPlan:
        """The plan in force (bound to the model once the Trainer has set it up), else the plan asked for."""
        applied = self._executor.plan
        return self._requested if applied is None else applied

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
        return self._executor.compiled

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the FP16 loss scaler skipped so far (counted on the device: reading it is a host sync)."""
        return self._skipped.value

    @property
    def executor(self) -> PlanExecutor:
        """The hook engine (for inspection)."""
        return self._executor

    def set_plan(self, plan: PlanLike) -> PrecisionPlan:
        """Replace the plan by one of the user's own; re-hooks the model at once if it is known (idempotent).

        A plan set here wins over a checkpoint's on resume, like the constructor's.

        Args:
            plan: the new plan (anything the constructor accepts).

        Returns:
            The plan now in force.

        Raises:
            PlanMismatchError: if the plan does not fit the model.
            PlanError: if an operator has no kernel for its planned precision on the model's device.
        """
        result = self._request(plan_from_any(plan), trial=False)
        self._users_own = True
        return result

    def try_plan(self, plan: PlanLike) -> PrecisionPlan:
        """Put in force a plan the caller tries on purpose (a search's trial, or the plan it chose).

        As :meth:`set_plan`, but the plan is not the user's own: no warning where its 16-bit precision is emulated
        on this device (the caller chose to try it there), and a checkpoint's plan replaces it on resume.

        Returns:
            The plan now in force.

        Raises:
            PlanMismatchError: if the plan does not fit the model.
            PlanError: if an operator has no kernel for its planned precision on the model's device.
        """
        result = self._request(plan_from_any(plan), trial=True)
        self._users_own = False
        return result

    def measured_step(self, plan: PlanLike, *, calibrated: bool = True) -> AbstractContextManager[None]:
        """Put ``plan`` in force (as :meth:`try_plan`) and return the context in which to run one training step
        outside Lightning's loop (a profiler's or a timer's) exactly as a training step of that plan runs.

        Lowered weights are saved for backward as training saves them (recipes re-cast in backward), and what
        operators save for backward is stored at its planned saved precision.

        Args:
            plan: the plan to run.
            calibrated: the cast boundaries of training: a lowered operator's output stays low where every consumer
                computes in the same precision (the first such step after the plan is applied traces them, the way
                the first training step does). ``False``: every lowered operator's output returns to FP32, so each
                operator is measured with its own casts.
        """
        self.try_plan(plan)
        if calibrated:
            return self._executor.step(StepKind.TRAIN)
        return self._executor.weight_cast_recording()

    def _request(self, plan: PrecisionPlan, trial: bool) -> PrecisionPlan:
        previous = self._requested, self._trial
        self._requested, self._trial = plan, trial
        if self._executor.model is not None:
            try:
                self._apply()
            except Exception:
                self._requested, self._trial = previous  # a rejected plan must not poison the next convert_module
                raise
        return self.plan

    def _apply(self) -> None:
        """Hook the model for the device it is on now (its parameters' device, read now, never remembered)."""
        model = self._executor.model
        assert model is not None
        device = model_device(model)
        target = device_class(device)
        plan = self._executor.apply(model, decline_slow_fp16(self._requested, target, self.allow_slow_fp16), device)
        self._optimizer_states.assign(model, plan)
        self._scaler.sync(plan.uses(ComputePrecision.FP16), device.type)
        if not self._trial:
            accepted = frozenset({ComputePrecision.FP16}) if self.allow_slow_fp16 else frozenset()
            check_plan_device(plan, model, target, stacklevel=4, accepted=accepted)
        self._report_unplanned()

    def _report_unplanned(self) -> None:
        """Warn when the plan leaves much of the traced step's work in FP32 unplanned (not for trials)."""
        self._unplanned.check(self._executor, self._users_own, type(self).__name__)

    def _ensure_placed(self) -> None:
        """Re-hook if the model computes somewhere else than the hooks were built for (Lightning moved it)."""
        if self._executor.model is not None and not self._executor.placed():
            self._apply()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(plan={self.plan!r}, allow_slow_fp16={self.allow_slow_fp16},"
                f" recast_weights_in_backward={self._executor.recast_weights_in_backward})")

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
        compiled = is_compiled(module)
        self._executor.attach(module, compiled=compiled)
        self._hook_guards.close()
        if compiled:
            self._hook_guards.enter_context(guarding_hooks())
        return module

    @override
    def connect(self, model: Any, optimizers: Any, lr_schedulers: Any) -> Any:
        if type(model).__name__ == "DeepSpeedEngine":
            raise UnsupportedSetupError(
                "CoMPPrecision cannot drive a DeepSpeed engine (backward and step must go through DeepSpeed's own"
                " precision plugin). Use strategy='ddp' or 'auto' with CoMPPrecision, or DeepSpeed without it."
            )
        if self._executor.model is not None:
            self._apply()  # Lightning has placed the model by now: hook it for its device
        for optimizer in optimizers or ():
            self._optimizer_states.watch(optimizer)  # before Lightning restores a checkpoint's optimizer states
        return super().connect(model, optimizers, lr_schedulers)

    @contextmanager
    def _step(self, kind: StepKind) -> Generator[None, None, None]:
        self._ensure_placed()
        with self._executor.step(kind):
            yield
        self._report_unplanned()  # the first step traced the model's work

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
        states = self._optimizer_states
        if isinstance(optimizer, Optimizer):
            if self.scaler is None and states.steps(optimizer):  # the plan manages some of its parameters
                states.watch(optimizer)
                result = self._wrap_closure(model, optimizer, closure)  # forward, backward, clipping: as the base
                states.step(optimizer, lambda: optimizer.step(**kwargs))
                return result
            states.convert(optimizer)  # moments a former plan kept in 8 bits or bf16: back to the optimizer's own
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        output, skipped = scaled_optimizer_step(self.scaler, optimizer, model, closure, self._after_closure, **kwargs)
        self._skipped.add(skipped)
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
        return PluginState(plan=self.plan.to_dict(), scaler=None if self.scaler is None else self.scaler.state_dict(),
                           skipped_steps=self.skipped_steps, optimizer_steps=self.optimizer_steps,
                           rounding=self._optimizer_states.rounding_state() or None).to_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the plan and re-apply it to the model (unless the user gave a plan of their own: it wins, with a
        warning naming what the checkpoint held), then the scaler and the step counters.

        Raises:
            PlanError: if the state is malformed, of another version, or has unknown keys.
            PlanMismatchError: if the stored plan was made for a different model.
        """
        state = PluginState.from_dict(state_dict)
        stored = PrecisionPlan.from_dict(state.plan)
        if not self._users_own:
            self._request(stored, trial=self._trial)
        elif not _same_assignment(stored, self.plan):
            rank_zero_warn(
                f"CoMPPrecision: the checkpoint holds the plan {_assignment(stored)}, but this run was given the plan"
                f" {_assignment(self.plan)}, which is kept. Pass CoMPPrecision() without a plan to resume with the"
                " checkpoint's.",
            )
        self._scaler.load(state.scaler, self.plan.uses(ComputePrecision.FP16), self._executor.model is not None)
        self._skipped = SkippedSteps(state.skipped_steps)
        self.optimizer_steps = state.optimizer_steps
        self._optimizer_states.load_rounding_state(state.rounding)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """File the state Lightning stored under this plugin's class name under ``"lightning_comp"`` instead, the
        same key for every plugin class of the package (a plan saved under DDP resumes under FSDP, and back)."""
        state = checkpoint.pop(type(self).__qualname__, None)
        checkpoint[CHECKPOINT_KEY] = self.state_dict() if state is None else state

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the state from ``"lightning_comp"`` (or the class-named key of checkpoints written before it,
        unless Lightning restored that already, under this very class's name).

        Raises:
            PlanError: if the state is malformed, of another version, or has unknown keys.
            PlanMismatchError: if the stored plan was made for a different model.
        """
        if CHECKPOINT_KEY in checkpoint:
            self.load_state_dict(checkpoint[CHECKPOINT_KEY])
            return
        for key in LEGACY_CHECKPOINT_KEYS:
            if key in checkpoint and key != type(self).__qualname__:
                self.load_state_dict(checkpoint[key])
                return

    @override
    def teardown(self) -> None:
        """Take the hooks off the model at the end of every fit/validate/test/predict.

        The model the user gets back computes in FP32 and is safe to deep-copy (EMA, teacher models): parameters the
        plan held in bf16 (``master="bf16"``) are FP32 again, exactly (their values are bf16 values). The plan stays
        inspectable (:attr:`plan`, ``executor.precisions()``) and the next stage, or :meth:`set_plan`, hooks it again.
        """
        self._executor.detach()
        self._optimizer_states.release()  # bf16 masters back to the dtypes the model came with
        self._hook_guards.close()
        super().teardown()

    def remove_hooks(self) -> None:
        """Take the plan off the model (it then computes in FP32 everywhere); :meth:`set_plan` puts one back."""
        self._executor.remove()
        self._optimizer_states.release()


def _same_assignment(a: PrecisionPlan, b: PrecisionPlan) -> bool:
    """Whether two plans assign the same precisions (whatever their fingerprints, devices and provenance)."""
    def assignment(plan: PrecisionPlan) -> tuple[Any, ...]:
        return (plan.entries, plan.default, plan.saved, plan.saved_default, plan.state, plan.state_default,
                plan.master, plan.master_default)

    return assignment(a) == assignment(b)


def _assignment(plan: PrecisionPlan) -> str:
    """The plan's entries for a message, e.g. ``{'head': 'bf16', '<default>': 'fp32'}``."""
    entries = {selector: precision.value for selector, precision in plan.entries}
    entries["<default>"] = plan.default.value
    for dimension in ("saved", "state", "master"):
        entries.update({f"{dimension} {selector}": value.value for selector, value in getattr(plan, dimension)})
    return repr(entries)
