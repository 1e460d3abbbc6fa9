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
from lightning_comp.errors import ConfigError, UnsupportedSetupError
from lightning_comp.execution.compiled_regions import guarding_hooks
from lightning_comp.execution.executor import StepKind
from lightning_comp.execution.gradient_release import release_gradients
from lightning_comp.execution.loss_scaling import scaled_optimizer_step
from lightning_comp.execution.plugin_state import CHECKPOINT_KEY
from lightning_comp.execution.saved_tensors import DEFAULT_MIN_SAVED_BYTES
from lightning_comp.execution.update_path import UpdatePath
from lightning_comp.plan.plan import PlanLike, PrecisionPlan
from lightning_comp.plugins.runtime import PlanOrigin, PlanRuntime
from lightning_comp.plugins.shell import PlanShell

__all__ = ["CoMPPrecision"]


class CoMPPrecision(PlanShell, Precision):
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

    **What the logs say.** ``trainer.precision`` stays ``"32-true"`` (Lightning's literal, the master weights'),
    :attr:`precision_label` says ``"comp-mixed"`` where the plan lowers anything, and at the fit's first training step
    a plan that was given (the user's, a checkpoint's) goes to every logger's ``log_hyperparams`` as
    :meth:`plan_hyperparameters` (``comp/precision``, ``comp/plan/<selector>``, operator counts, device class,
    fingerprints); a search's chosen plan goes there when it is chosen.

    **A search's entry points.** :meth:`try_plan` puts a plan in force that the caller tries on purpose;
    :meth:`measured_step` runs a training step of a plan outside Lightning's loop exactly as training would run it.
    ``CoMPSearch`` drives the plugin through these two only.

    The plugin maps Lightning's hooks onto its :class:`~lightning_comp.plugins.runtime.PlanRuntime`, which owns the
    plan, the executor, the loss scaler, the optimizer-state manager and the checkpoint state (the Fabric plugin
    shares it).

    Args:
        plan: a :class:`PrecisionPlan`, a ``{selector: precision}`` mapping, a path to a plan saved with
            :meth:`PrecisionPlan.save`, or ``None`` for all-FP32 until a :class:`~lightning_comp.CoMPSearch` sets one.
            A fit with ``None``, no ``CoMPSearch`` among the Trainer's callbacks and no checkpoint's plan to resume
            warns at its first training step that it trains entirely in FP32; ``{}`` (all FP32 on purpose) does not.
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
        update_path: the code that steps parameters whose plan entry sets ``state``/``master`` precision:
            ``"auto"`` (on a CPU the native step, a C loop built here at first use; on CUDA, and on a CPU where no
            C compiler builds it, compiled with ``torch.compile`` where that pays: always on CUDA, on a CPU once a
            step's managed parameters hold 2^20 elements; eager where compiling fails; each fallback warned),
            ``"native"`` (an error where it cannot be built; compiled on CUDA), ``"compiled"`` (an error where it
            cannot compile) or ``"eager"`` (op by op). See :mod:`lightning_comp.execution.update_path`.
        fsdp2_policies: under FSDP2, every unit's ``MixedPrecisionPolicy`` follows the plan in force (a fixed plan, a
            search's every trial and the plan it chooses, a later :meth:`set_plan`): a unit whose operators with
            parameters all compute in one 16-bit dtype all-gathers in it (half the bytes), gradients reduced in FP32
            (:mod:`lightning_comp.execution.fsdp2_policies`). Its numerics are the hooks' except where the unit's
            parameters are read outside their operator (a tied weight, a model's own functional code) or by a norm a
            CPU lowers by an input cast (FP32 affine parameters under the hooks): those read the 16-bit copy. A
            search validates with the same policies it trains with. ``False`` leaves the policies ``fully_shard``
            was given alone (the hooks lower per operator, FP32 all-gathers).
        release_gradients_after_step: after each optimizer step, the gradients of that optimizer's parameters are
            set to ``None`` (as ``zero_grad`` does). Lightning's loop zeroes them only after the *next* training
            step's forward, so without this they are held through that forward, on top of its activations, where a
            step's peak usually is (the default example: 12.7 MiB of FP32 gradients over a forward that peaks at
            ~130 MiB). Training is bit-identical either way (gradient accumulation included: only a real optimizer
            step releases); the difference a user sees is that ``p.grad`` is ``None`` from the step to the next
            backward, e.g. in ``on_train_batch_end`` and ``on_before_zero_grad``: read gradients in
            ``on_before_optimizer_step`` (Lightning's place for gradient norms), or pass ``False``.

    Raises:
        PlanError: if ``plan`` cannot be read.
        ConfigError: if ``min_saved_bytes`` is not an integer >= 0, ``update_path`` not one of the four, or
            ``release_gradients_after_step`` not a bool.
    """

    # master weights and everything outside the plan's operators; keeps Lightning's literal (ModelSummary warns on any
    # other string at every fit; FSDP and ThroughputMonitor read it): what the run computes in is ``precision_label``
    precision = "32-true"

    def __init__(
        self,
        plan: PlanLike = None,
        *,
        allow_slow_fp16: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        recast_weights_in_backward: bool = True,
        min_saved_bytes: int = DEFAULT_MIN_SAVED_BYTES,
        update_path: UpdatePath | str = UpdatePath.AUTO,
        fsdp2_policies: bool = True,
        release_gradients_after_step: bool = True,
    ) -> None:
        Precision.__init__(self)  # (not super(): a subclass that is also an FSDPPrecision must not run its __init__)
        self._runtime = PlanRuntime(plan, owner=type(self).__name__, hooks_on_attach=True,
                                    allow_slow_fp16=allow_slow_fp16, scaler=scaler, scaler_factory=self._new_scaler,
                                    recast_weights_in_backward=recast_weights_in_backward,
                                    min_saved_bytes=min_saved_bytes, update_path=update_path,
                                    fsdp2_policies=fsdp2_policies)
        self._hook_guards = ExitStack()  # while a compiled model trains: Dynamo guards on hooks
        self._training_begun = False  # the fit's first training step ran (its checks and logging are done)
        self._plan_expected = False  # a search said it will put a plan in force during this fit
        if not isinstance(release_gradients_after_step, bool):
            raise ConfigError(f"release_gradients_after_step={release_gradients_after_step!r} is invalid: it must be"
                              " True or False.")
        self.release_gradients_after_step = release_gradients_after_step

    def _new_scaler(self, device_type: str) -> torch.amp.GradScaler:
        """The loss scaler an FP16 plan gets on ``device_type`` (a strategy's plugin may need another kind)."""
        return torch.amp.GradScaler(device=device_type)

    # ------------------------------------------------------------------------------------ a search's entry points
    def try_plan(self, plan: PlanLike, *, chosen: bool = False) -> PrecisionPlan:
        """Put in force a plan the caller tries on purpose (a search's trial), or the plan it chose after trying.

        As :meth:`set_plan`, but the plan is not the user's own: no warning where its 16-bit precision is emulated
        on this device (the caller chose to try it there), and a checkpoint's plan replaces it on resume. A trial
        gets no warning where it leaves work unplanned either; a chosen plan (``chosen=True``), which trains on, does.

        Returns:
            The plan now in force.

        Raises:
            PlanMismatchError: if the plan does not fit the model.
            PlanError: if an operator has no kernel for its planned precision on the model's device.
        """
        return self._runtime.request(plan, PlanOrigin.CHOSEN if chosen else PlanOrigin.TRIAL)

    @property
    def update_path(self) -> UpdatePath:
        """The code that steps the parameters a plan's ``state``/``master`` entries manage, as configured (under
        ``"auto"`` it decides per step)."""
        return self._runtime.optimizer_states.updates.path

    def expect_plan(self) -> None:
        """Say that a plan will be put in force during this fit (``CoMPSearch`` says so at its ``setup``), so a fit
        that starts with no plan is not warned about as one that trains all in FP32. Holds until :meth:`teardown`."""
        self._plan_expected = True

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
            return self._runtime.executor.step(StepKind.TRAIN)
        return self._runtime.executor.weight_cast_recording()

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
        compiled = self._runtime.attach(module)
        self._training_begun = False
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
        if self._runtime.executor.model is not None:
            self._runtime.apply()  # Lightning has placed the model by now: hook it for its device
        for optimizer in optimizers or ():
            self._runtime.optimizer_states.watch(optimizer)  # before Lightning restores a checkpoint's states
        return super().connect(model, optimizers, lr_schedulers)

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        if not self._training_begun:
            self._training_begun = True
            self._begin_training()
        with self._runtime.step(StepKind.TRAIN):
            yield

    def _begin_training(self) -> None:
        """At a fit's first training step (a checkpoint's plan is in force by then, and a search has started or not):
        warn where nobody gave this plugin a plan and no ``CoMPSearch`` will, and send a plan that was given (the
        user's, a checkpoint's, a search's chosen one on resume) to the Trainer's loggers as hyperparameters."""
        trainer = getattr(self._runtime.executor.model, "_trainer", None)
        if trainer is None:
            return
        if self._runtime.unplanned:
            if not self._plan_expected:
                rank_zero_warn(
                    f"{type(self).__name__} was given no plan and the Trainer has no CoMPSearch callback to choose"
                    " one: this fit trains entirely in fp32. Pass a plan (e.g. CoMPPrecision({'type:Linear':"
                    " 'bf16'}), or the plan.json a search saved), add CoMPSearch() to the Trainer's callbacks, or"
                    " pass CoMPPrecision({}) to train in fp32 on purpose."
                )
            return
        if self._runtime.origin is not PlanOrigin.TRIAL:  # a trial's plan is logged by its search, per trial
            params = self.plan_hyperparameters()
            for logger in trainer.loggers:
                logger.log_hyperparams(params)

    @override
    @contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        with self._runtime.step(StepKind.VALIDATION):
            yield

    @override
    @contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        with self._runtime.step(StepKind.TEST):
            yield

    @override
    @contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        with self._runtime.step(StepKind.PREDICT):
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
        with self._runtime.executor.recomputing():
            super().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        runtime = self._runtime
        if runtime.begin_optimizer_step(optimizer):  # the plan manages some of its parameters
            assert isinstance(optimizer, Optimizer)
            output = self._wrap_closure(model, optimizer, closure)  # forward, backward, clipping: as the base
            runtime.managed_step(optimizer, lambda: optimizer.step(**kwargs))
        elif self.scaler is None:
            output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        else:
            output, skipped = scaled_optimizer_step(self.scaler, optimizer, model, closure, self._after_closure,
                                                    **kwargs)
            runtime.count_skipped(skipped)
        if self.release_gradients_after_step:
            release_gradients(optimizer)
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
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """File the state Lightning stored under this plugin's class name under ``"lightning_comp"`` instead, the
        same key for every plugin class of the package (a plan saved under DDP resumes under FSDP, and back)."""
        state = checkpoint.pop(type(self).__qualname__, None)
        checkpoint[CHECKPOINT_KEY] = self.state_dict() if state is None else state

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the state from ``"lightning_comp"`` (a checkpoint without it holds no plan: nothing to restore).

        Raises:
            PlanError: if the state is malformed, of another version, or has unknown keys.
            PlanMismatchError: if the stored plan was made for a different model.
        """
        if CHECKPOINT_KEY in checkpoint:
            self.load_state_dict(checkpoint[CHECKPOINT_KEY])

    @override
    def teardown(self) -> None:
        """Take the hooks off the model at the end of every fit/validate/test/predict.

        The model the user gets back computes in FP32 and is safe to deep-copy (EMA, teacher models): parameters the
        plan held in bf16 (``master="bf16"``) are FP32 again, exactly (their values are bf16 values). The plan stays
        inspectable (:attr:`plan`, ``executor.precisions()``) and the next stage, or :meth:`set_plan`, hooks it again.
        """
        self._runtime.release()
        self._hook_guards.close()
        self._plan_expected = False
        super().teardown()

    def remove_hooks(self) -> None:
        """Take the plan off the model (it then computes in FP32 everywhere); :meth:`set_plan` puts one back."""
        self._runtime.remove()

