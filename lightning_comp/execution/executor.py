"""Executing a precision plan on a model through forward pre/post hooks.

:class:`PlanExecutor` registers one pre-hook and one post-hook per operator and puts each operator's precision into
effect the way that suits it (:class:`~lightning_comp.operators.discovery.Lowering`): an autocast region for matmul,
conv and
attention (and for recurrent operators where it runs on the device); a cast of the input for norms and element-wise
operators; low-precision copies of the FP32 parameters for other modules with weights. Master weights are never
modified: they stay FP32 and receive FP32 gradients through the differentiable casts.

**Cast boundaries** (:mod:`lightning_comp.execution.cast_boundaries`). A low-precision operator's output stays in the
low dtype only where every consumer of it is an operator of the same low precision; anywhere else it is cast back to
FP32. The consumers are found by tracing the first step of each kind (train/validation/test/predict) after a plan
is applied. Calls outside a step, and operators the trace did not see, always cast back to FP32.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.hooks import RemovableHandle

from lightning_comp.devices.device_class import device_class, model_device
from lightning_comp.errors import PlanError
from lightning_comp.execution.cast_boundaries import (
    LOW_DTYPES,
    ConsumerTracer,
    HookedOperator,
    StepKind,
    cast_floating,
    has_low,
    iter_tensors,
    note_failing_operator,
)
from lightning_comp.execution.compiled_regions import (
    EagerCall,
    compiling,
    eager,
    enter_autocast,
    exit_autocast,
    only_inlined,
    untraceable,
)
from lightning_comp.execution.saved_tensors import DEFAULT_MIN_SAVED_BYTES, SavedTensorCompressor
from lightning_comp.execution.weight_casts import WeightCastRecorder
from lightning_comp.numerics.precision import Precision
from lightning_comp.numerics.saved_precision import SavedPrecision
from lightning_comp.operators.discovery import Lowering, classify, iter_operators, lowering_for, weight_reading
from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["StepKind", "PlanExecutor", "cast_floating"]

# The executor whose hooks are on each model. A model carries one plan at a time: applying another executor (a new
# CoMPPrecision for the same model, e.g. a second Trainer) takes the previous one's hooks off first.
_OWNERS: weakref.WeakKeyDictionary[nn.Module, PlanExecutor] = weakref.WeakKeyDictionary()
class PlanExecutor:
    """Puts a :class:`PrecisionPlan` into effect on a model, in place, through forward hooks.

    :meth:`apply` is idempotent: it removes the hooks of the previous plan before adding new ones, so it can run on
    every ``fit``/``validate`` call. An all-FP32 plan registers no hook at all.

    Args:
        recast_weights_in_backward: inside steps, save lowered weights for backward as recipes and cast the FP32
            masters again in backward instead of keeping the 16-bit copies (see
            :mod:`lightning_comp.execution.weight_casts`).
        min_saved_bytes: operators whose plan entry saves ``bf16``/``fp8`` store smaller tensors as they are (see
            :mod:`lightning_comp.execution.saved_tensors`).
    """

    def __init__(self, recast_weights_in_backward: bool = True,
                 min_saved_bytes: int = DEFAULT_MIN_SAVED_BYTES) -> None:
        self.recast_weights_in_backward = bool(recast_weights_in_backward)
        self._weight_casts = WeightCastRecorder()
        self._saved = SavedTensorCompressor(min_saved_bytes, is_weight_copy=self._weight_casts.made)
        self._handles: list[RemovableHandle | EagerCall] = []
        self._operators: dict[str, HookedOperator] = {}
        self._plan: PrecisionPlan | None = None
        self._model: nn.Module | None = None
        self._device: torch.device | None = None
        self._chained: dict[StepKind, frozenset[str]] = {}
        self._current_chained: frozenset[str] = frozenset()
        self._last_step_chained: frozenset[str] = frozenset()  # what the latest step's forward chained
        self._tracer: ConsumerTracer | None = None
        self._warned_ineffective: set[str] = set()
        self._calibrations: dict[tuple[Any, ...], dict[StepKind, frozenset[str]]] = {}
        self._compiled = False

    # ---------------------------------------------------------------------------------------------------- state
    @property
    def plan(self) -> PrecisionPlan | None:
        """The plan in effect, or ``None`` if none was applied."""
        return self._plan

    @property
    def model(self) -> nn.Module | None:
        """The model the hooks are on."""
        return self._model

    @property
    def device(self) -> torch.device | None:
        """The device the hooks were built for (``None`` before :meth:`apply`)."""
        return self._device

    @property
    def num_hooks(self) -> int:
        """How many hook handles are registered (2 per hooked operator; 1 per operator run outside compiled graphs)."""
        return len(self._handles)

    @property
    def compiled(self) -> bool:
        """Whether the hooks are built to be traced into ``torch.compile`` graphs (see :meth:`apply`)."""
        return self._compiled

    @property
    def saved_tensors(self) -> SavedTensorCompressor:
        """The engine that stores operators' saved tensors at their planned saved precision."""
        return self._saved

    def saved_precisions(self) -> dict[str, SavedPrecision]:
        """The saved precision of each hooked operator."""
        return {name: op.saved for name, op in self._operators.items()}

    def precisions(self) -> dict[str, Precision]:
        """The effective precision of each hooked operator (FP32 where a low precision cannot apply)."""
        return {name: (op.precision if op.low else Precision.FP32) for name, op in self._operators.items()}

    def chained_operators(self, kind: StepKind) -> frozenset[str]:
        """Low-precision operators whose output stays low in steps of ``kind`` (empty until calibrated)."""
        return self._chained.get(kind, frozenset())

    # ------------------------------------------------------------------------------------------------ lifecycle
    def apply(self, model: nn.Module, plan: PrecisionPlan, device: torch.device | str | None = None, *,
              device_type: str | None = None, compiled: bool = False) -> PrecisionPlan:
        """Hook ``model`` so each operator computes in the precision ``plan`` assigns it.

        Args:
            model: the model to hook (mutated in place: hooks only, parameters untouched).
            plan: the plan; validated against the model first.
            device: where the model computes; default: the device of its parameters now. The hooks are built for
                this device: after moving the model, apply the plan again (``CoMPPrecision`` does so by itself).
            device_type: the name this argument had before 0.2 (a device type string such as ``"cpu"``).
            compiled: the model runs under ``torch.compile``: build hooks TorchDynamo traces into the graph
                (:mod:`lightning_comp.execution.compiled_regions`). Their autocast regions are entered functionally,
                weights are
                not re-cast in backward (AOTAutograd decides what backward keeps), and the steps that calibrate cast
                boundaries run eagerly.

        Returns:
            The plan bound to ``model`` (with its fingerprint and the device class it runs on).

        Raises:
            PlanMismatchError: if the plan does not fit the model.
            PlanError: if an operator cannot compute in its planned precision on this device (before any step runs),
                or if ``compiled`` and the plan saves tensors for backward in a lower precision.
        """
        device = device if device is not None else device_type
        target = model_device(model) if device is None else torch.device(device)
        bound = plan if plan.fingerprint is not None else plan.bind(model, target)
        bound.validate(model)
        operators: dict[str, HookedOperator] = {}
        unsupported = []
        for name, module in iter_operators(model):
            precision = bound.precision_of(name, type(module))
            lowering = lowering_for(module, precision, target)
            if lowering is None:
                unsupported.append(f"{name or '<root>'} ({type(module).__name__}, {precision.value})")
                continue
            operators[name] = HookedOperator(name, module, classify(module), precision, lowering,
                                             saved=bound.saved_of(name, type(module)))
        if unsupported:
            raise PlanError(
                f"{len(unsupported)} operator(s) have no kernel for their planned precision on {target}"
                f" [{device_class(target).describe()}]: {', '.join(unsupported)}. Assign them 'fp32' in the plan"
                " (e.g. {'<name>': 'fp32'}), or let CoMPSearch choose on this device."
            )
        compressing = sorted(name or "<root>" for name, op in operators.items() if op.saved.compresses)
        if compiled and compressing:
            raise PlanError(
                f"The plan saves tensors for backward in a lower precision ({', '.join(compressing)}), which"
                " torch.compile cannot trace: AOTAutograd decides what a compiled graph saves. Drop the plan's"
                " 'saved' entries for a compiled model (CoMPSearch(saved_precision='off')), or train it uncompiled."
            )
        self.remove()
        self._compiled = bool(compiled)
        owner = _OWNERS.get(model)
        if owner is not None and owner is not self:
            owner.remove()  # stale hooks of another executor would keep computing the old plan
        _OWNERS[model] = self
        self._operators = operators
        self._plan = bound
        self._model = model
        self._device = target
        self._saved.watch(model)
        # Cast boundaries depend only on the model's call pattern and the plan: re-applying a plan seen before
        # (the search alternates plans) reuses its calibration instead of tracing again.
        key = (weakref.ref(model), bound.entries, bound.default, str(target))  # a dead model never matches
        self._chained = self._calibrations.setdefault(key, {})
        if not bound.is_all_fp32 and not any(op.low and not op.transparent for op in operators.values()):
            low = sorted({p.value for p in (bound.default, *(p for _, p in bound.entries)) if p is not Precision.FP32})
            rank_zero_warn(
                f"The plan assigns {'/'.join(low)} but no operator of {type(model).__name__} computes in it on"
                f" {target}: its 16-bit entries match only shape-only operators, or operators with no"
                " low-precision kernel there. Training runs in fp32.",
                stacklevel=2,
            )
        if any(op.low or op.saved.compresses for op in operators.values()):
            for op in operators.values():
                pre_hook, post_hook = self._make_pre_hook(op), self._make_post_hook(op)
                if self._compiled and untraceable(op.module):  # a graph break inside its region would drop it
                    self._handles.append(EagerCall(op.module, pre_hook, post_hook))
                    continue
                self._handles.append(op.module.register_forward_pre_hook(pre_hook, with_kwargs=True))
                self._handles.append(op.module.register_forward_hook(post_hook, always_call=True))
        return bound

    def detach(self) -> None:
        """Take the hooks off the model but keep the plan, precisions and calibration for inspection.

        The model then computes in FP32 (and deep copies of it carry no hook); :meth:`apply` puts the hooks back.
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for op in self._operators.values():
            while op.contexts:
                op.contexts.pop().__exit__(None, None, None)
        if self._model is not None and _OWNERS.get(self._model) is self:
            del _OWNERS[self._model]

    def remove(self) -> None:
        """Remove every hook and forget calibration; the model is left exactly as it was."""
        self.detach()
        self._operators = {}
        self._chained = {}
        self._current_chained = frozenset()
        self._plan = None
        self._device = None

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Backward of the latest step: forwards re-run in it (activation checkpointing) chain and save lowered
        operators' outputs exactly as that step's forward did, so they recompute the same dtypes."""
        if not self._handles:
            yield
            return
        self._current_chained = self._last_step_chained
        try:
            with self.weight_cast_recording():
                yield
        finally:
            self._current_chained = frozenset()

    def weight_cast_recording(self) -> AbstractContextManager[Any]:
        """Save lowered weights for backward as recipes, as training steps do (for profiling outside a step)."""
        return self._weight_casts.recording() if self._recasting and self._handles else nullcontext()

    @property
    def _recasting(self) -> bool:
        return self.recast_weights_in_backward and not self._compiled

    @contextmanager
    def step(self, kind: StepKind) -> Iterator[None]:
        """Run one Lightning step of ``kind``; the first one after a plan is applied calibrates cast boundaries."""
        if not self._handles:
            yield
            return
        recording = self._weight_casts.recording() if self._recasting else nullcontext()
        if kind in self._chained:
            self._current_chained = self._last_step_chained = self._chained[kind]
            try:
                with recording:
                    yield
            finally:
                self._current_chained = frozenset()
                self._saved.clear()
            return
        self._last_step_chained = frozenset()  # a calibrating step hands every output on in fp32
        tracer = ConsumerTracer(self._operators)
        self._tracer = tracer
        try:
            with eager() if self._compiled else nullcontext(), tracer, recording:
                yield
        finally:
            self._tracer = None
            self._saved.clear()
        self._chained[kind] = tracer.chained()
        self._warn_ineffective(tracer.ineffective)

    def _warn_ineffective(self, names: set[str]) -> None:
        fresh = sorted(names - self._warned_ineffective)
        if fresh:
            self._warned_ineffective.update(fresh)
            described = ", ".join(f"{n} ({type(self._operators[n].module).__name__})" for n in fresh)
            rank_zero_warn(
                f"Plan entries had no effect: {described} computed in float32 although the plan assigns a 16-bit"
                " precision (PyTorch has no lower-precision kernel for them on this device, or they do no"
                " floating-point work). Assign them 'fp32' to silence this warning.",
                stacklevel=2,
            )

    # ---------------------------------------------------------------------------------------------------- hooks
    def _make_pre_hook(self, op: HookedOperator) -> Any:
        dtype = op.precision.dtype
        lowering = op.lowering
        assert self._device is not None
        device_type = self._device.type  # hooks are rebuilt when the model moves (apply is called again)
        prefix = f"{op.name}." if op.name else ""  # qualified names, for error messages
        # Linear/Conv-like operators get their 16-bit weight copies from the executor (so they can be re-cast in
        # backward instead of kept); other autocast-lowered modules are left to autocast.
        recast_own = lowering is Lowering.AUTOCAST and weight_reading(op.module)
        casts = self._weight_casts

        # (attribute name, qualified name, parameter) of the hooked module, resolved once for the hot path
        own = {recurse: [(n, prefix + n, p) for n, p in op.module.named_parameters(recurse=recurse)]
               for recurse in (False, True)}

        def low_copies(module: nn.Module, recurse: bool) -> dict[str, torch.Tensor]:
            # The parameters of the module being called: a deep copy of the model (an EMA or teacher model) carries
            # these hooks too and must compute with its own weights, not the original's.
            params = own[recurse] if module is op.module else [
                (n, prefix + n, p) for n, p in module.named_parameters(recurse=recurse)]
            return {n: casts.cast(qualified, p, dtype) for n, qualified, p in params}

        saved = op.saved
        compressor = self._saved

        def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            tracer = self._tracer
            if tracer is not None:
                tracer.enter(op, args, kwargs)
            if op.transparent:
                return None
            contexts: list[AbstractContextManager[Any]] = []  # entered now, left in the post-hook
            result = None
            if lowering is Lowering.AUTOCAST and compiling():  # a region Dynamo traces into the graph
                op.contexts.append(enter_autocast(device_type, dtype))
                return None
            if lowering is Lowering.AUTOCAST:
                contexts.append(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
                if recast_own and casts.active:  # autocast finds the weights already low and leaves them be
                    contexts.append(_reparametrize_module(module, low_copies(module, recurse=False)))
            elif lowering is Lowering.INPUT or lowering is Lowering.PARAMS:
                args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
                copies = low_copies(module, recurse=True) if lowering is Lowering.PARAMS else {}
                if copies:
                    contexts.append(_reparametrize_module(module, copies))
                result = args, kwargs
            elif lowering is Lowering.NONE and has_low((args, kwargs)):
                to_fp32 = torch.float32
                result = cast_floating(args, to_fp32, LOW_DTYPES), cast_floating(kwargs, to_fp32, LOW_DTYPES)
            if saved.compresses:
                hooks = compressor.context(saved)
                if hooks is not None:
                    contexts.append(hooks)
            if contexts:
                ctx = contexts[0] if len(contexts) == 1 else ExitStack()
                if isinstance(ctx, ExitStack):
                    for context in contexts:
                        ctx.enter_context(context)
                else:
                    ctx.__enter__()
                op.contexts.append(ctx)
            return result

        return only_inlined(pre_hook)

    def _make_post_hook(self, op: HookedOperator) -> Any:
        dtype = op.precision.dtype
        # an RNN's flat-weight list still points at the low copies once its parameters are swapped back
        rnn = op.lowering is Lowering.PARAMS and isinstance(op.module, nn.RNNBase)
        functional_region = op.lowering is Lowering.AUTOCAST

        def post_hook(module: nn.Module, args: Any, output: Any) -> Any:
            if functional_region and op.contexts and compiling():
                exit_autocast(op.contexts.pop())
            elif op.contexts:
                op.contexts.pop().__exit__(None, None, None)
                if rnn:
                    module._update_flat_weights()  # type: ignore[operator]
            if output is None and (op.low or op.saved.compresses):
                note_failing_operator(op, self._device)  # always_call: forward raised, name the operator
            if op.low and not op.transparent and output is not None:
                if op.lowering is Lowering.OUTPUT:
                    output = cast_floating(output, dtype)
                tracer = self._tracer
                if tracer is not None and not any(t.dtype == dtype for t in iter_tensors(output)):
                    tracer.ineffective.add(op.name)
                if op.name not in self._current_chained:
                    output = cast_floating(output, torch.float32, LOW_DTYPES)
            tracer = self._tracer
            if tracer is not None:
                tracer.exit(op, output)
            return output

        return only_inlined(post_hook)
