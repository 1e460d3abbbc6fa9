"""``PlanRuntime``: a plan put into effect for a training loop, whichever framework drives it.

The package's plugins are shells over one runtime each: the Trainer's ``CoMPPrecision`` (and its FSDP1 form) and
Fabric's ``CoMPFabricPrecision`` map their framework's hooks onto it, and it owns everything else:

- the executor (the model, the plan in force bound to it, the device its hooks were built for);
- the plan asked for and its :class:`PlanOrigin` (the user's own wins over a checkpoint's, with a warning naming
  both; a trial gets no warnings about emulated precisions or unplanned work);
- the loss scaler of FP16 plans and the steps it skipped, the optimizer-state manager, the step count;
- the plugin's checkpoint state (:class:`~lightning_comp.execution.plugin_state.PluginState`).

The frameworks differ in when the model may be hooked: the Trainer places the model before its ``connect`` and hooks
it as soon as it is attached; Fabric places it only before its first forward, so until then a plan asked for is
only checked against the model (``hooks_on_attach=False``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from enum import Enum
from typing import Any

import torch
from lightning.fabric.utilities import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_comp.devices.device_classes import DeviceClass, device_class, model_device
from lightning_comp.execution.compiled_regions import is_compiled
from lightning_comp.execution.emulation import check_plan_device, decline_slow_fp16
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.execution.fsdp2_policies import PolicyFollower
from lightning_comp.execution.loss_scaling import ScalerSlot, SkippedSteps
from lightning_comp.execution.optimizer_states import OptimizerStates
from lightning_comp.execution.plugin_state import PluginState
from lightning_comp.execution.unplanned_work import UnplannedWorkWarnings
from lightning_comp.execution.update_path import UpdatePath
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PlanLike, PrecisionPlan, plan_from_any

__all__ = ["PlanOrigin", "PlanRuntime"]


class PlanOrigin(Enum):
    """Who asked for the plan a runtime puts in force: what a checkpoint's plan does to it, and which warnings it gets.

    Attributes:
        DEFAULT: nobody (all-FP32 until a checkpoint's plan replaces it), or a checkpoint.
        USER: the user (a plugin's constructor or ``set_plan``): it wins over a checkpoint's plan, with a warning.
        TRIAL: a caller trying it on purpose (``try_plan``: a search's trials and measurements): no warnings about
            emulated precisions or unplanned work; a checkpoint's plan replaces it, as a trial.
        CHOSEN: the plan a caller chose after trying (``try_plan(plan, chosen=True)``: a search's result), which trains
            on: no warning about emulated precisions (the caller measured them there), but work it leaves
            unplanned is reported, as for a checkpoint's plan; a checkpoint's plan replaces it.
    """

    DEFAULT = "default"
    USER = "user"
    TRIAL = "trial"
    CHOSEN = "chosen"


class PlanRuntime:
    """The plan, the model it is put into effect on, and everything a step under it needs (see the module docstring).

    Args:
        plan: the plan asked for (anything :func:`~lightning_comp.plan.plan.plan_from_any` accepts); a plan given
            here is the user's own, ``None`` is all-FP32 by default.
        owner: the plugin's name, for messages.
        hooks_on_attach: whether the model may be hooked as soon as it is attached (the Trainer's), or only once
            :meth:`ensure_placed` first hooked it on its device (Fabric's, at its first forward).
        allow_slow_fp16: keep FP16 entries on a device without fast FP16.
        scaler: a loss scaler of the user's own for FP16 plans.
        scaler_factory: makes the loss scaler of FP16 plans for a device type (default ``torch.amp.GradScaler``).
        recast_weights_in_backward: as the plugins'.
        min_saved_bytes: as the plugins'.
        update_path: as the plugins'.
        fsdp2_policies: as the plugins'.
    """

    def __init__(self, plan: PlanLike, *, owner: str, hooks_on_attach: bool, allow_slow_fp16: bool,
                 scaler: torch.amp.GradScaler | None, scaler_factory: Callable[[str], torch.amp.GradScaler] | None,
                 recast_weights_in_backward: bool, min_saved_bytes: int,
                 update_path: UpdatePath | str = UpdatePath.AUTO, fsdp2_policies: bool = True) -> None:
        self.owner = owner
        self.requested = plan_from_any(plan)  # asked for; the executor holds it bound, in force
        self.origin = PlanOrigin.DEFAULT if plan is None else PlanOrigin.USER
        self.allow_slow_fp16 = bool(allow_slow_fp16)
        self.executor = PlanExecutor(recast_weights_in_backward=recast_weights_in_backward,
                                     min_saved_bytes=min_saved_bytes)
        self.optimizer_states = OptimizerStates(update_path)
        # FSDP2 units' MixedPrecisionPolicy, kept on the plan in force (None: left as fully_shard got them)
        self.policies = PolicyFollower() if fsdp2_policies else None
        self.optimizer_steps = 0
        self.planned_by_checkpoint = False  # a checkpoint's plan was put in force (see :attr:`unplanned`)
        self._hooks_on_attach = hooks_on_attach
        self._scaler = ScalerSlot(scaler, scaler_factory)
        self._skipped = SkippedSteps()
        self._unplanned = UnplannedWorkWarnings()

    # -------------------------------------------------------------------------------------------------- state
    @property
    def plan(self) -> PrecisionPlan:
        """The plan in force (bound to the model once hooked), else the plan asked for."""
        applied = self.executor.plan
        return self.requested if applied is None else applied

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler (FP16 plans only, or the user's own)."""
        return self._scaler.scaler

    @property
    def device(self) -> DeviceClass | None:
        """The class of the device the plan runs (or last ran) on, ``None`` until the model is hooked."""
        device = self.executor.device
        return None if device is None else device_class(device)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the FP16 loss scaler skipped so far (reading it is a host sync)."""
        return self._skipped.value

    @property
    def unplanned(self) -> bool:
        """Whether nobody gave this runtime a plan: no plan of the user's own (an explicit all-FP32 one counts as
        given), none a caller tried or chose (``try_plan``), and no checkpoint's plan that lowers anything or that a
        search or a user chose (its provenance says who made it)."""
        return self.origin is PlanOrigin.DEFAULT and not self.planned_by_checkpoint

    @property
    def hookable(self) -> bool:
        """Whether a plan asked for goes on the model now (else it is only checked against the model, if any)."""
        return self.executor.model is not None and (self._hooks_on_attach or self.executor.device is not None)

    # --------------------------------------------------------------------------------------------- the plan
    def request(self, plan: PlanLike, origin: PlanOrigin) -> PrecisionPlan:
        """Ask for ``plan`` (of ``origin``): hooked at once where :attr:`hookable`; a plan the model rejects leaves
        the previous one asked for.

        Returns:
            The plan now in force (or asked for, before the model is hooked).

        Raises:
            PlanMismatchError: if the plan does not fit the model.
            PlanError: if an operator has no kernel for its planned precision on the model's device.
        """
        previous = self.requested, self.origin
        self.requested, self.origin = plan_from_any(plan), origin
        try:
            if self.hookable:
                self.apply()
            elif self.executor.model is not None:
                self.requested.validate(self.executor.model)
        except Exception:
            self.requested, self.origin = previous  # a rejected plan must not poison the next attach
            raise
        return self.plan

    def attach(self, module: nn.Module) -> bool:
        """Check the plan fits ``module`` and make it the model (hooked once placed); returns whether it is compiled.

        Raises:
            PlanMismatchError: if the plan does not fit ``module``.
        """
        self.requested.validate(module)
        compiled = is_compiled(module)
        self.executor.attach(module, compiled=compiled)
        return compiled

    def apply(self) -> None:
        """Hook the model for the device it is on now (its parameters' device, read now, never remembered)."""
        model = self.executor.model
        assert model is not None
        device = model_device(model)
        target = device_class(device)
        plan = self.executor.apply(model, decline_slow_fp16(self.requested, target, self.allow_slow_fp16), device)
        if self.policies is not None:  # FSDP2 units all-gather in the dtype the plan computes them in
            self.policies.follow(model, plan)
        self.optimizer_states.assign(model, plan)
        self._scaler.sync(plan.uses(ComputePrecision.FP16), device.type)
        if self.origin not in (PlanOrigin.TRIAL, PlanOrigin.CHOSEN):
            accepted = frozenset({ComputePrecision.FP16}) if self.allow_slow_fp16 else frozenset()
            check_plan_device(plan, model, target, stacklevel=5, accepted=accepted)
        self.report_unplanned()

    def ensure_placed(self) -> None:
        """Hook the model if it computes somewhere else than the hooks were built for (first use, or it moved)."""
        if self.executor.model is not None and not self.executor.placed():
            self.apply()

    def report_unplanned(self) -> None:
        """Warn when the plan leaves much of the traced step's work in FP32 unplanned (once traced; not for trials)."""
        if self.origin is not PlanOrigin.TRIAL:
            self._unplanned.check(self.executor, self.origin is PlanOrigin.USER, self.owner)

    @contextmanager
    def step(self, kind: StepKind) -> Generator[None, None, None]:
        """One step of ``kind`` under the plan (the model hooked for its device first)."""
        self.ensure_placed()
        with self.executor.step(kind):
            yield
        self.report_unplanned()  # the first step traced the model's work

    def release(self) -> None:
        """Take the hooks off (the plan stays inspectable) and give bf16 masters their own dtypes back."""
        self.executor.detach()
        self.optimizer_states.release()

    def remove(self) -> None:
        """Take the plan off the model: it computes in FP32 everywhere, as it came."""
        self.executor.remove()
        self.optimizer_states.release()

    # ----------------------------------------------------------------------------------------- optimizer step
    def begin_optimizer_step(self, optimizer: Any) -> bool:
        """Count a step of ``optimizer``; whether the plan manages some of its parameters, so that it must be stepped
        with :meth:`managed_step` (else the state a former plan kept in 8 bits or bf16 returns to its own format)."""
        self.optimizer_steps += 1
        if not isinstance(optimizer, Optimizer):
            return False
        if self.scaler is None and self.optimizer_states.steps(optimizer):
            self.optimizer_states.watch(optimizer)
            return True
        self.optimizer_states.convert(optimizer)
        return False

    def managed_step(self, optimizer: Optimizer, own_step: Callable[[], Any]) -> Any:
        """Step the managed parameters of ``optimizer`` here, the rest with ``own_step()``; return what it returns."""
        return self.optimizer_states.step(optimizer, own_step)

    def count_skipped(self, skipped: torch.Tensor | bool) -> None:
        """Count one loss-scaled step, skipped or not (a 0-d bool tensor on the scaler's device, or a bool)."""
        self._skipped.add(skipped)

    # ---------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The plan (plain Python types, loadable with ``weights_only=True``), scaler state and step counters."""
        return PluginState(plan=self.plan.to_dict(), scaler=None if self.scaler is None else self.scaler.state_dict(),
                           skipped_steps=self.skipped_steps, optimizer_steps=self.optimizer_steps,
                           rounding=self.optimizer_states.rounding_state() or None).to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put the checkpoint's plan in force (unless the user's own is: it wins, with a warning naming what the
        checkpoint held), then the scaler, the step counters and the rounding generators.

        Raises:
            PlanError: if the state is malformed, of another version, or has unknown keys.
            PlanMismatchError: if the stored plan was made for a different model.
        """
        state = PluginState.from_dict(state_dict)
        stored = PrecisionPlan.from_dict(state.plan)
        if self.origin is not PlanOrigin.USER:
            self.request(stored, self.origin)  # a search resuming from its checkpoint goes on trying
            # an all-FP32 plan nobody made (a run given no plan wrote it) is no plan to follow
            self.planned_by_checkpoint = any(a.changes for a in stored.assignments) or bool(stored.provenance)
        elif not stored.same_assignments(self.plan):
            rank_zero_warn(
                f"{self.owner}: the checkpoint holds the plan {_described(stored)}, but this run was given the plan"
                f" {_described(self.plan)}, which is kept. Pass {self.owner}() without a plan to resume with the"
                " checkpoint's.",
            )
        self._scaler.load(state.scaler, self.plan.uses(ComputePrecision.FP16), self.hookable)
        self._skipped = SkippedSteps(state.skipped_steps)
        self.optimizer_steps = state.optimizer_steps
        self.optimizer_states.load_rounding_state(state.rounding)


def _described(plan: PrecisionPlan) -> str:
    """The plan's entries for a message, e.g. ``{'head': 'bf16', '<default>': 'fp32', 'state head': '8bit'}``."""
    entries: dict[str, str] = {}
    for assignment in plan.assignments:
        prefix = "" if assignment.dimension is Dimension.COMPUTE else f"{assignment.dimension.value} "
        entries.update({f"{prefix}{selector}": value for selector, value in assignment.to_dict().items()})
        if not prefix:
            entries["<default>"] = assignment.default.value
    return repr(entries)
