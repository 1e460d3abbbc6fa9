"""Executing a precision plan on a model through forward pre/post hooks: :class:`PlanExecutor`.

The executor registers one pre-hook and one post-hook per operator (:mod:`lightning_comp.execution.hooks`), which put
each operator's precision into effect the way that suits it (:class:`~lightning_comp.devices.lowering.Lowering`).
Once a step of a kind has calibrated (:mod:`lightning_comp.execution.calibration`), the FP32 operators whose hooks
changed nothing in it are unhooked (:mod:`lightning_comp.execution.hook_registry`). The hooks never modify
the parameters: each receives its gradient in its own dtype through the differentiable casts (FP32, unless a plan's
``master`` entry made it BF16: :mod:`lightning_comp.execution.optimizer_states`).

It is the one owner of what a plan's execution depends on: the model, the plan in force (bound to the model), the
device the hooks were built for, and whether the model runs compiled. A model carries one executor's plan at a time.

**Cast boundaries** (:mod:`lightning_comp.execution.cast_boundaries`). A low-precision operator's output stays in
the low dtype only where every consumer of it is an operator of the same low precision; anywhere else it is cast
back to FP32. The consumers are found by tracing the first step of each kind (train/validation/test/predict) after a
plan is applied. Calls outside a step, and operators the trace did not see, always cast back to FP32.

**Operators found by tracing** (:mod:`lightning_comp.operators.owned_work`). The first step of each kind a model runs
is also traced for the work its modules do themselves: a container found computing between its children (an
attention module calling ``scaled_dot_product_attention`` or ``einsum``) becomes a ``FUNCTIONAL`` operator, and the
plan is applied again with it. So that this first step already computes such work in its planned precision, every
container not traced yet is hooked for it as a *provisional* operator (an autocast region in its planned precision,
which changes nothing in a container that does no such work); its cast boundaries are then conservative, and the
step calibrates them only if no new operator was found (else the next step of that kind does).

**Recomputation** (:mod:`lightning_comp.execution.recompute`). When an operator of the plan saves ``recompute``,
the forward of every training step runs inside the recomputer's saved-tensor hooks, which store recipes instead of
that operator's outputs wherever they are saved; other kinds of step, and plans without such an entry, run without.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

from lightning_comp.devices.device_classes import model_device
from lightning_comp.execution.calibration import Calibration, Calibrations, CastBoundaries
from lightning_comp.execution.cast_boundaries import ConsumerTracer
from lightning_comp.execution.compiled_regions import eager
from lightning_comp.execution.hook_registry import HookNeeds, HookRegistry
from lightning_comp.execution.hooks import HookedOperator, PostHook, PreHook, StepState, make_hooks
from lightning_comp.execution.plan_warnings import PlanWarnings
from lightning_comp.execution.planned_operators import hooked_operators, provisional_operators
from lightning_comp.execution.recompute import Recomputer
from lightning_comp.execution.saved_tensors import DEFAULT_MIN_SAVED_BYTES, SavedTensorCompressor
from lightning_comp.execution.upcast_saving import UpcastSaver
from lightning_comp.execution.weight_casts import WeightCastRecorder
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.discovery import iter_operators, iter_untraced_containers
from lightning_comp.operators.owned_work import StepWork, WorkRecorder
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["PlanExecutor", "StepKind"]


class StepKind(str, Enum):
    """The kind of Lightning step a forward belongs to; cast boundaries are calibrated per kind."""

    TRAIN = "train"
    VALIDATION = "validation"
    TEST = "test"
    PREDICT = "predict"


# The executor whose hooks are on each model. A model carries one plan at a time: applying another executor (a new
# CoMPPrecision for the same model, e.g. a second Trainer) takes the previous one's hooks off first.
_OWNERS: weakref.WeakKeyDictionary[nn.Module, PlanExecutor] = weakref.WeakKeyDictionary()


@dataclass
class _WorkTrace:
    """Which kinds of step the model's own work was traced in (for which model), and the work found."""

    model: weakref.ref[nn.Module] | None = None
    kinds: set[StepKind] = field(default_factory=set)
    work: StepWork | None = None  # that of the first traced step, or of the latest traced training step

    def needed(self, model: nn.Module, kind: StepKind) -> bool:
        """Whether a step of ``kind`` on ``model`` is to be traced (a new model starts over)."""
        if self.model is None or self.model() is not model:
            self.model = weakref.ref(model)
            self.kinds = set()
        return kind not in self.kinds

    def done(self, kind: StepKind, work: StepWork) -> None:
        """A step of ``kind`` was traced and found ``work``."""
        self.kinds.add(kind)
        if self.work is None or kind is StepKind.TRAIN:
            self.work = work


class PlanExecutor:
    """Puts a :class:`PrecisionPlan` into effect on a model, in place, through forward hooks.

    :meth:`apply` is idempotent: it removes the hooks of the previous plan before adding new ones, so it can run on
    every ``fit``/``validate`` call. An all-FP32 plan registers no hook at all.

    Args:
        recast_weights_in_backward: inside steps, save lowered weights for backward as recipes and cast the FP32
            masters again in backward instead of keeping the 16-bit copies
            (:mod:`lightning_comp.execution.weight_casts`).
        min_saved_bytes: operators whose plan entry saves ``bf16``/``fp8`` store smaller tensors as they are
            (:mod:`lightning_comp.execution.saved_tensors`).
    """

    def __init__(self, recast_weights_in_backward: bool = True,
                 min_saved_bytes: int = DEFAULT_MIN_SAVED_BYTES) -> None:
        self.recast_weights_in_backward = bool(recast_weights_in_backward)
        # the step's state the hooks read, the engines they call, and the hooks registered
        self._upcasts = UpcastSaver()
        self._step_state = StepState(upcasts=self._upcasts)
        self._weight_casts = WeightCastRecorder()
        self._saved_tensors = SavedTensorCompressor(min_saved_bytes, is_weight_copy=self._weight_casts.made)
        self._recomputer = Recomputer(self._step_state)
        self._hooks = HookRegistry(self._make_hooks)  # (a bound method: the plugin pickles for ddp_spawn)
        # the model, and the plan in force on it
        self._model: nn.Module | None = None
        self._compiled = False
        self._plan: PrecisionPlan | None = None
        self._operators: dict[str, HookedOperator] = {}
        self._hook_needs = HookNeeds()
        self._in_force = False  # the plan's hooks are on the model (an all-FP32 plan needs none)
        # what steps found
        self._calibrations = Calibrations()  # of every plan applied so far
        self._calibration = Calibration()  # of the plan in force
        self._last_step_chained: frozenset[str] = frozenset()  # what the latest step's forward chained
        self._work_trace = _WorkTrace()
        self._warnings = PlanWarnings()  # (each said once)

    # ---------------------------------------------------------------------------------------------------- state
    @property
    def plan(self) -> PrecisionPlan | None:
        """The plan applied last (bound to the model), or ``None`` if none was applied since :meth:`remove`."""
        return self._plan

    @property
    def model(self) -> nn.Module | None:
        """The model the plan is for (known from :meth:`attach` or :meth:`apply` on)."""
        return self._model

    @property
    def device(self) -> torch.device | None:
        """The device the hooks were built for (``None`` before :meth:`apply`)."""
        return self._step_state.device

    @property
    def compiled(self) -> bool:
        """Whether the hooks are built to be traced into ``torch.compile`` graphs (see :meth:`apply`)."""
        return self._compiled

    @property
    def num_hooks(self) -> int:
        """How many hook handles are registered (2 per hooked operator; 1 per operator run outside compiled graphs)."""
        return len(self._hooks)

    def hooked_operators(self) -> frozenset[str]:
        """The operators carrying hooks now (see :mod:`lightning_comp.execution.hook_registry`)."""
        return frozenset(name for name in self._operators if name in self._hooks)

    @property
    def saved_tensors(self) -> SavedTensorCompressor:
        """The engine that stores operators' saved tensors at their planned saved precision."""
        return self._saved_tensors

    @property
    def recomputer(self) -> Recomputer:
        """The engine that stores recipes instead of the outputs of operators saving ``recompute``."""
        return self._recomputer

    def precisions(self) -> dict[str, ComputePrecision]:
        """The effective precision of each hooked operator (FP32 where a low precision cannot apply)."""
        return {name: (op.precision if op.low else ComputePrecision.FP32) for name, op in self._operators.items()}

    def chained_operators(self, kind: StepKind) -> frozenset[str]:
        """Low-precision operators whose output stays low in steps of ``kind`` (empty until calibrated)."""
        return self._calibration.chained(kind)

    @property
    def work(self) -> StepWork | None:
        """The compute-heavy work of the model's first traced step, by owning module (``None`` before it ran)."""
        return self._work_trace.work

    def placed(self) -> bool:
        """Whether the plan is in force for the device the model computes on now (Lightning may have moved it)."""
        return self._in_force and self._model is not None and model_device(self._model) == self.device

    # ------------------------------------------------------------------------------------------------ lifecycle
    def attach(self, model: nn.Module, *, compiled: bool = False) -> None:
        """Make ``model`` the model of the next :meth:`apply` without hooking it yet (it may not be on its device).

        Hooks of an earlier plan come off and the plan is forgotten; the next :meth:`apply` hooks ``model``.

        Args:
            model: the model.
            compiled: whether it runs under ``torch.compile`` (see :meth:`apply`).
        """
        self.remove()
        self._model = model
        self._compiled = bool(compiled)

    def apply(self, model: nn.Module, plan: PrecisionPlan, device: torch.device | str | None = None, *,
              compiled: bool | None = None) -> PrecisionPlan:
        """Hook ``model`` so each operator computes in the precision ``plan`` assigns it.

        Args:
            model: the model to hook (mutated in place: hooks only, parameters untouched).
            plan: the plan; validated against the model first.
            device: where the model computes; default: the device of its parameters now. The hooks are built for
                this device: after moving the model, apply the plan again (``CoMPPrecision`` does so by itself).
            compiled: the model runs under ``torch.compile``: build hooks TorchDynamo traces into the graph
                (:mod:`lightning_comp.execution.compiled_regions`). Their autocast regions are entered functionally,
                weights are not re-cast in backward (AOTAutograd decides what backward keeps), and the steps that
                calibrate cast boundaries run eagerly. ``None``: as :meth:`attach` said (else ``False``).

        Returns:
            The plan bound to ``model`` (with its fingerprint and the device class it runs on).

        Raises:
            PlanMismatchError: if the plan does not fit the model.
            PlanError: if an operator cannot compute in its planned precision on this device (before any step runs),
                or if ``compiled`` and the plan saves tensors for backward in a lower precision.
        """
        target = model_device(model) if device is None else torch.device(device)
        compiled = (self._compiled if model is self._model else False) if compiled is None else bool(compiled)
        bound = plan if plan.fingerprint is not None else plan.bind(model, target)
        bound.validate(model)
        operators = hooked_operators(model, bound, target, compiled)
        self.remove()
        owner = _OWNERS.get(model)
        if owner is not None and owner is not self:
            owner.remove()  # stale hooks of another executor would keep computing the old plan
        _OWNERS[model] = self
        self._operators, self._plan, self._model, self._compiled = operators, bound, model, compiled
        self._step_state.device = target
        self._saved_tensors.watch(model)
        # re-applying a plan seen before (the search alternates plans) reuses its calibration
        compute = bound[Dimension.COMPUTE]
        self._calibration = self._calibrations.of(model, (compute.entries, compute.default), target)
        self._warnings.nothing_lowered(model, bound, operators, target)
        self._install()
        return bound

    def _install(self) -> None:
        """Register the hooks of the plan (none when no operator computes or saves in a lower precision): every
        operator's, then, for the kinds of step calibrated already, only those that change something."""
        self._in_force = True
        self._hook_needs = HookNeeds.of(self._operators)
        # compressing operators leave recompute operators' outputs to the recipes (no check without any)
        self._saved_tensors.defer_to(self._recomputer.claims if self._hook_needs.recomputes else None)
        if not self._hook_needs.always_hooked:
            return
        self._hooks.hook(self._operators.values(), compiled=self._compiled)
        self._prune()

    def _make_hooks(self, op: HookedOperator) -> tuple[PreHook, PostHook]:
        return make_hooks(op, self._step_state, self._weight_casts, self._saved_tensors, self._recomputer)

    def _prune(self) -> None:
        """Take the hooks off the FP32 operators that change nothing in any kind of step calibrated so far (see
        :mod:`lightning_comp.execution.hook_registry`); steps of a kind not calibrated yet re-hook them first. Not
        under ``torch.compile``: hooks traced into a graph cost nothing per call, and changing them recompiles."""
        if self._compiled or not self._calibration or not self._hook_needs.always_hooked:
            return
        keep = self._hook_needs.always_hooked | self._calibration.fed_low()
        self._hooks.unhook([name for name in self._operators if name not in keep])

    def _hook_all(self) -> list[str]:
        """Hook the plan's operators that carry no hooks now (for a calibrating or tracing step); return them."""
        return self._hooks.hook(self._operators.values(), compiled=self._compiled)

    def _drop_provisional(self, provisional: dict[str, HookedOperator]) -> None:
        """Take a tracing step's provisional operators off again."""
        self._hooks.unhook(provisional)
        for name, op in provisional.items():
            self._operators.pop(name, None)
            while op.contexts:  # left entered only by a forward that raised before its post-hook
                op.contexts.pop().__exit__(None, None, None)
        self._step_state.regions = 0

    def _uninstall(self) -> None:
        """Remove the hooks and leave whatever a hook left entered (a forward that raised mid-way)."""
        self._hooks.clear()
        for op in self._operators.values():
            while op.contexts:
                op.contexts.pop().__exit__(None, None, None)
            while op.shields:
                shield = op.shields.pop()
                if shield is not None:
                    shield.exit()
        self._step_state.regions = 0

    def detach(self) -> None:
        """Take the hooks off the model but keep the plan, precisions and calibration for inspection.

        The model then computes in FP32 (and deep copies of it carry no hook); :meth:`apply` puts the hooks back.
        """
        self._uninstall()
        if self._model is not None and _OWNERS.get(self._model) is self:
            del _OWNERS[self._model]
        self._in_force = False

    def remove(self) -> None:
        """Remove every hook and forget the plan and its calibration; the model is left exactly as it was."""
        self.detach()
        self._operators = {}
        self._calibration = Calibration()
        self._step_state.chained = frozenset()
        self._plan = None
        self._step_state.device = None

    # ---------------------------------------------------------------------------------------------------- steps
    @contextmanager
    def step(self, kind: StepKind) -> Iterator[None]:
        """Run one Lightning step of ``kind``; the first one of each kind traces the model's own work (see the
        module docstring), the first one after a plan is applied calibrates cast boundaries.

        Raises:
            PlanMismatchError: after a tracing step, if a plan entry names containers none of which computes.
            PlanError: after a tracing step, if a container found computing has no way of lowering on the device.
        """
        if self._model is not None and self._work_trace.needed(self._model, kind):
            with self._tracing_step(kind):
                yield
            return
        if not self._hooks:
            yield
            return
        assert self._model is not None
        if self._hook_needs.compresses:  # parameters may have been replaced since the last step (walking them costs)
            self._saved_tensors.watch(self._model)
        recording = self._weight_casts.recording() if self._recasting else nullcontext()
        recipes = self._recipes(kind)
        state = self._step_state
        if self._calibration.calibrated(kind):
            state.chained = self._last_step_chained = self._calibration.chained(kind)
            try:
                with self._upcast_saving(kind), recording, recipes:
                    yield
            finally:
                state.chained = frozenset()
                self._saved_tensors.clear()
            return
        self._last_step_chained = frozenset()  # a calibrating step hands every output on in fp32
        self._hook_all()  # it finds the call pattern with every operator hooked
        tracer = state.tracer = ConsumerTracer(self._operators)
        try:
            with eager() if self._compiled else nullcontext(), tracer, self._upcast_saving(kind), recording, recipes:
                yield
        finally:
            state.tracer = None
            self._saved_tensors.clear()
        self._calibrated(kind, tracer)
        self._warnings.ineffective(tracer.ineffective, self._operators)

    def _upcast_saving(self, kind: StepKind) -> AbstractContextManager[Any]:
        """Where saved FP32 copies of low outputs are stored as the outputs (:mod:`~lightning_comp.execution.
        upcast_saving`): a training step's forward where autograd records, under a plan that sets what some operator
        saves (``bf16``/``fp8``/``recompute``: a plan made for memory; the hooks' Python pack costs ~7 us per saved
        tensor, +11 % of the step of a model of 32-wide Linears), but not a compiled model's (its graphs inline the
        hooks; saved-tensor hooks would break them)."""
        needs = self._hook_needs
        if kind is StepKind.TRAIN and not self._compiled and (needs.compresses or needs.recomputes):
            return self._upcasts.recording()
        return nullcontext()

    def _recipes(self, kind: StepKind) -> AbstractContextManager[Any]:
        """Where recompute operators store recipes: the forward of a training step, when the plan has any."""
        return self._recomputer.recording() if self._hook_needs.recomputes and kind is StepKind.TRAIN else nullcontext()

    def _calibrated(self, kind: StepKind, tracer: ConsumerTracer) -> None:
        """Keep what a calibrating step of ``kind`` found, and take off the hooks that change nothing."""
        self._calibration.record(kind, CastBoundaries(tracer.chained(), frozenset(tracer.fed_low)))
        self._prune()

    @contextmanager
    def _tracing_step(self, kind: StepKind) -> Iterator[None]:
        """A step that records which modules own compute-heavy work, with provisional operators hooked."""
        model = self._model
        assert model is not None
        plan, device = self._plan, self._step_state.device
        untraced = next(iter_untraced_containers(model), None) is not None
        provisional: dict[str, HookedOperator] = {}
        if plan is not None and device is not None and self._in_force:
            provisional = provisional_operators(model, plan, device, self._operators)
        planned = bool(self._hooks)  # the plan's own hooks (whose order among other hooks stays as it is)
        hooked = planned or any(op.low for op in provisional.values())
        # every operator hooked: FP32 ones shield themselves from the provisional regions, and the step may calibrate
        added = self._hook_all() if hooked else []
        if provisional:
            self._operators = {**self._operators, **provisional}
            self._hooks.hook(provisional.values(), compiled=self._compiled)
        before = set(self._operators) - set(provisional)
        self._last_step_chained = frozenset()  # a tracing step hands every output on in fp32, as a calibrating one
        recording = self._weight_casts.recording() if self._recasting and hooked else nullcontext()
        tracer = ConsumerTracer(self._operators, frozenset(provisional)) if hooked else None
        self._step_state.tracer = tracer
        self._saved_tensors.watch(model)
        recorder = WorkRecorder(model)
        try:
            upcasts = self._upcast_saving(kind) if hooked else nullcontext()
            with eager() if self._compiled else nullcontext(), recorder, \
                    tracer if tracer is not None else nullcontext(), upcasts, recording, self._recipes(kind):
                yield
        except BaseException:
            self._drop_provisional(provisional)
            self._hooks.unhook([] if planned else added)
            raise
        finally:
            self._step_state.tracer = None
            self._saved_tensors.clear()
        self._work_trace.done(kind, recorder.work)
        self._drop_provisional(provisional)
        if not planned:  # an all-FP32 plan carries no hooks after the trace
            self._hooks.unhook(added)
        found = [name for name, _ in iter_operators(model) if name not in self._operators]
        if found and plan is not None and device is not None and self._in_force:
            self.apply(model, plan, device, compiled=self._compiled)  # the operators found join the plan's
        elif plan is not None and untraced:
            plan.validate(model)  # entries that waited for the trace: each must now match an operator
        new = set(self._operators) - before
        if new:  # cast boundaries found without these operators no longer hold
            self._calibrations.forget()
        if tracer is not None:
            if not new and self._hooks:
                self._calibrated(kind, tracer)
            self._warnings.ineffective(tracer.ineffective & set(self._operators), self._operators)

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Backward of the latest step: forwards re-run in it (activation checkpointing) chain and save lowered
        operators' outputs exactly as that step's forward did, so they recompute the same dtypes."""
        if not self._hooks:
            yield
            return
        self._step_state.chained = self._last_step_chained
        try:
            with self._weight_casts.recording() if self._recasting else nullcontext():
                yield
        finally:
            self._step_state.chained = frozenset()

    @contextmanager
    def weight_cast_recording(self) -> Iterator[None]:
        """Save lowered weights for backward as recipes, and recompute operators' outputs as theirs, as training
        steps do (for a training step run outside Lightning's, uncalibrated)."""
        if not self._hooks:
            yield
            return
        casts = self._weight_casts.recording() if self._recasting else nullcontext()
        with self._upcast_saving(StepKind.TRAIN), casts, self._recipes(StepKind.TRAIN):
            yield

    @property
    def _recasting(self) -> bool:
        return self.recast_weights_in_backward and not self._compiled
