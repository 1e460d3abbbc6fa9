"""Executing a precision plan on a model through forward pre/post hooks.

:class:`PlanExecutor` registers one pre-hook and one post-hook per operator and puts each operator's precision into
effect the way that suits it (:class:`~lightning_comp.operators.Lowering`): an autocast region for matmul, conv,
LSTM and attention; a cast of the input for norms and element-wise operators; low-precision copies of the FP32
parameters for other modules with weights. Master weights are never modified: they stay FP32 and receive FP32
gradients through the differentiable casts.

**Cast boundaries.** A low-precision operator's output stays in the low dtype only where every consumer of it is an
operator of the same low precision; anywhere else (an FP32 operator, a functional op outside any operator, the loss,
the caller) it is cast back to FP32. The consumers are found by tracing the first step of each kind
(train/validation/test/predict) after a plan is applied, with a ``TorchFunctionMode`` that sees every torch call made
outside operators. Calls outside a step, and operators the trace did not see, always cast back to FP32.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_comp.devices import device_class, model_device
from lightning_comp.dtypes import Precision
from lightning_comp.errors import PlanError
from lightning_comp.operators import Lowering, OperatorKind, classify, iter_operators, lowering_for
from lightning_comp.plan import PrecisionPlan
from lightning_comp.weight_casts import WeightCastRecorder

__all__ = ["StepKind", "PlanExecutor", "cast_floating"]

_LOW_DTYPES = (torch.bfloat16, torch.float16)
# Autocast-lowered modules whose forward reads its own parameters: their 16-bit weight copies are made by the executor
# (so they can be re-cast in backward instead of kept); other autocast-lowered modules are left to autocast.
_RECASTABLE = (nn.Linear, nn.modules.conv._ConvNd)
# The executor whose hooks are on each model. A model carries one plan at a time: applying another executor (a new
# CoMPPrecision for the same model, e.g. a second Trainer) takes the previous one's hooks off first.
_OWNERS: weakref.WeakKeyDictionary[nn.Module, PlanExecutor] = weakref.WeakKeyDictionary()
# Tensor metadata reads that neither consume values nor create tensors: they never force a cast boundary.
_METADATA_GETTERS = frozenset({"shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "grad_fn",
                               "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "grad", "_version"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "is_floating_point",
                               "element_size", "__len__", "data_ptr", "get_device", "__repr__", "__format__",
                               "storage_offset", "nelement", "ndimension", "is_complex"})


class StepKind(str, Enum):
    """The kind of Lightning step a forward belongs to; cast boundaries are calibrated per kind."""

    TRAIN = "train"
    VALIDATION = "validation"
    TEST = "test"
    PREDICT = "predict"


def cast_floating(obj: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] | None = None) -> Any:
    """Cast every floating tensor in a nested structure (tensor, tuple, list, dict, namedtuple) to ``dtype``.

    Args:
        obj: the structure.
        dtype: target dtype.
        only: if given, cast only tensors whose dtype is in ``only``.
    """
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype != dtype and (only is None or obj.dtype in only):
            return obj.to(dtype)
        return obj
    if isinstance(obj, tuple):
        items = [cast_floating(o, dtype, only) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [cast_floating(o, dtype, only) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype, only) for k, v in obj.items()}
    return obj


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _iter_tensors(o)


def _has_low(obj: Any) -> bool:
    return any(t.dtype in _LOW_DTYPES for t in _iter_tensors(obj))


@dataclass(eq=False)
class _Operator:
    """Run-time state of one hooked operator."""

    name: str
    module: nn.Module
    kind: OperatorKind
    precision: Precision
    lowering: Lowering
    contexts: list[AbstractContextManager[Any]] = field(default_factory=list)

    @property
    def low(self) -> bool:
        return self.lowering is not Lowering.NONE

    @property
    def transparent(self) -> bool:
        return self.kind is OperatorKind.SHAPE


class _ConsumerTracer(TorchFunctionMode):
    """Records, for one step, which operators consume each low-precision operator's output."""

    def __init__(self, operators: dict[str, _Operator]) -> None:
        super().__init__()
        self.operators = operators
        self.depth = 0
        # Keyed by id(); each entry keeps a weak reference so that an id reused by a new tensor after the old one
        # died is not mistaken for it. (Holding the outputs alive instead would keep every low activation of the
        # calibration step until its end: +150-200 MiB on a small GPT/CNN.)
        self.producers: dict[int, frozenset[str]] = {}
        self.refs: dict[int, weakref.ref[torch.Tensor]] = {}
        self.consumed: set[str] = set()
        self.escaped: set[str] = set()
        self.pending: list[frozenset[str]] = []
        self.ineffective: set[str] = set()
        # Per call: the operators an output is attributed to, and which calls had no output used inside the step
        # (returned to the caller, e.g. from ``predict_step``): those must return in FP32 too.
        self.call_of: dict[int, int] = {}
        self.call_names: list[frozenset[str]] = []
        self.unused_calls: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.depth == 0 and self.producers and not _is_metadata(func):
            for tensor in _iter_tensors((args, kwargs)):
                if self._known(tensor):
                    self.escaped.update(self.producers[id(tensor)])
                    self.unused_calls.discard(self.call_of[id(tensor)])
        return func(*args, **kwargs)

    def enter(self, op: _Operator, args: Any, kwargs: Any) -> None:
        self.depth += 1
        sources: set[str] = set()
        for tensor in _iter_tensors((args, kwargs)):
            if not self._known(tensor):
                continue
            self.unused_calls.discard(self.call_of[id(tensor)])
            for producer in self.producers[id(tensor)]:
                sources.add(producer)
                self.consumed.add(producer)
                if op.transparent:
                    continue
                if not (op.low and op.precision is self.operators[producer].precision):
                    self.escaped.add(producer)
        self.pending.append(frozenset(sources))

    def exit(self, op: _Operator, output: Any) -> None:
        sources = self.pending.pop() if self.pending else frozenset()
        attributed = sources if op.transparent else (frozenset({op.name}) if op.low else frozenset())
        if attributed:
            call = len(self.call_names)
            self.call_names.append(attributed)
            self.unused_calls.add(call)
            for tensor in _iter_tensors(output):
                self.producers[id(tensor)] = attributed
                self.call_of[id(tensor)] = call
                self.refs[id(tensor)] = weakref.ref(tensor)
        self.depth -= 1

    def _known(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is an output this tracer recorded (and not a new tensor that reuses a dead one's id)."""
        ref = self.refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def chained(self) -> frozenset[str]:
        """Low-precision operators whose output may stay in the low dtype."""
        unused = {name for call in self.unused_calls for name in self.call_names[call]}
        return frozenset(
            name for name, op in self.operators.items()
            if op.low and not op.transparent and name in self.consumed and name not in self.escaped
            and name not in unused
        )


def _note_failing_operator(op: _Operator, device: torch.device | None) -> None:
    """Add to an exception raised inside a lowered operator which operator, precision and device it was."""
    error = sys.exc_info()[1]
    if error is None or getattr(error, "_comp_operator", None) is not None or not hasattr(error, "add_note"):
        return
    error._comp_operator = op.name  # type: ignore[attr-defined]  # the innermost operator notes it, once
    where = "unknown device" if device is None else f"{device} [{device_class(device).describe()}]"
    error.add_note(
        f"lightning-comp: raised inside operator {op.name or '<root>'!r} ({type(op.module).__name__}) computing in"
        f" {op.precision.value} ({op.lowering.value} lowering) on {where}. Assign it 'fp32' in the plan, or exclude"
        " it from the search with CoMPSearch(exclude=[...])."
    )


def _is_metadata(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_GETTERS
    return name in _METADATA_METHODS


class PlanExecutor:
    """Puts a :class:`PrecisionPlan` into effect on a model, in place, through forward hooks.

    :meth:`apply` is idempotent: it removes the hooks of the previous plan before adding new ones, so it can run on
    every ``fit``/``validate`` call. An all-FP32 plan registers no hook at all.

    Args:
        recast_weights_in_backward: inside steps, save lowered weights for backward as recipes and cast the FP32
            masters again in backward instead of keeping the 16-bit copies (see :mod:`lightning_comp.weight_casts`).
    """

    def __init__(self, recast_weights_in_backward: bool = True) -> None:
        self.recast_weights_in_backward = bool(recast_weights_in_backward)
        self._weight_casts = WeightCastRecorder()
        self._handles: list[RemovableHandle] = []
        self._operators: dict[str, _Operator] = {}
        self._plan: PrecisionPlan | None = None
        self._model: nn.Module | None = None
        self._device: torch.device | None = None
        self._chained: dict[StepKind, frozenset[str]] = {}
        self._current_chained: frozenset[str] = frozenset()
        self._tracer: _ConsumerTracer | None = None
        self._warned_ineffective: set[str] = set()
        self._calibrations: dict[tuple[Any, ...], dict[StepKind, frozenset[str]]] = {}

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
        """How many hook handles are registered (2 per hooked operator)."""
        return len(self._handles)

    def precisions(self) -> dict[str, Precision]:
        """The effective precision of each hooked operator (FP32 where a low precision cannot apply)."""
        return {name: (op.precision if op.low else Precision.FP32) for name, op in self._operators.items()}

    def chained_operators(self, kind: StepKind) -> frozenset[str]:
        """Low-precision operators whose output stays low in steps of ``kind`` (empty until calibrated)."""
        return self._chained.get(kind, frozenset())

    # ------------------------------------------------------------------------------------------------ lifecycle
    def apply(self, model: nn.Module, plan: PrecisionPlan, device: torch.device | str | None = None, *,
              device_type: str | None = None) -> PrecisionPlan:
        """Hook ``model`` so each operator computes in the precision ``plan`` assigns it.

        Args:
            model: the model to hook (mutated in place: hooks only, parameters untouched).
            plan: the plan; validated against the model first.
            device: where the model computes; default: the device of its parameters now. The hooks are built for
                this device: after moving the model, apply the plan again (``CoMPPrecision`` does so by itself).
            device_type: the name this argument had before 0.2 (a device type string such as ``"cpu"``).

        Returns:
            The plan bound to ``model`` (with its fingerprint and the device class it runs on).

        Raises:
            PlanMismatchError: if the plan does not fit the model.
            PlanError: if an operator cannot compute in its planned precision on this device (before any step runs).
        """
        device = device if device is not None else device_type
        target = model_device(model) if device is None else torch.device(device)
        bound = plan if plan.fingerprint is not None else plan.bind(model, target)
        bound.validate(model)
        operators: dict[str, _Operator] = {}
        unsupported = []
        for name, module in iter_operators(model):
            precision = bound.precision_of(name, type(module))
            lowering = lowering_for(module, precision, target)
            if lowering is None:
                unsupported.append(f"{name or '<root>'} ({type(module).__name__}, {precision.value})")
                continue
            operators[name] = _Operator(name, module, classify(module), precision, lowering)
        if unsupported:
            raise PlanError(
                f"{len(unsupported)} operator(s) have no kernel for their planned precision on {target}"
                f" [{device_class(target).describe()}]: {', '.join(unsupported)}. Assign them 'fp32' in the plan"
                " (e.g. {'<name>': 'fp32'}), or let CoMPSearch choose on this device."
            )
        self.remove()
        owner = _OWNERS.get(model)
        if owner is not None and owner is not self:
            owner.remove()  # stale hooks of another executor would keep computing the old plan
        _OWNERS[model] = self
        self._operators = operators
        self._plan = bound
        self._model = model
        self._device = target
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
        if any(op.low for op in operators.values()):
            for op in operators.values():
                self._handles.append(op.module.register_forward_pre_hook(self._make_pre_hook(op), with_kwargs=True))
                self._handles.append(op.module.register_forward_hook(self._make_post_hook(op), always_call=True))
        return bound

    def remove(self) -> None:
        """Remove every hook and forget calibration; the model is left exactly as it was."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for op in self._operators.values():
            while op.contexts:
                op.contexts.pop().__exit__(None, None, None)
        self._operators = {}
        self._chained = {}
        self._current_chained = frozenset()
        self._plan = None
        self._device = None
        if self._model is not None and _OWNERS.get(self._model) is self:
            del _OWNERS[self._model]

    @contextmanager
    def step(self, kind: StepKind) -> Iterator[None]:
        """Run one Lightning step of ``kind``; the first one after a plan is applied calibrates cast boundaries."""
        if not self._handles:
            yield
            return
        recording = (self._weight_casts.recording() if self.recast_weights_in_backward
                     else nullcontext())
        if kind in self._chained:
            self._current_chained = self._chained[kind]
            try:
                with recording:
                    yield
            finally:
                self._current_chained = frozenset()
            return
        tracer = _ConsumerTracer(self._operators)
        self._tracer = tracer
        try:
            with tracer, recording:
                yield
        finally:
            self._tracer = None
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
    def _make_pre_hook(self, op: _Operator) -> Any:
        dtype = op.precision.dtype
        lowering = op.lowering
        assert self._device is not None
        device_type = self._device.type  # hooks are rebuilt when the model moves (apply is called again)
        # (attribute name, qualified name for error messages, parameter), resolved once rather than on every call
        prefix = f"{op.name}." if op.name else ""
        params = ([(n, prefix + n, p) for n, p in op.module.named_parameters()]
                  if lowering is Lowering.PARAMS else [])
        own_params = ([(n, prefix + n, p) for n, p in op.module.named_parameters(recurse=False)]
                      if lowering is Lowering.AUTOCAST and isinstance(op.module, _RECASTABLE) else [])
        casts = self._weight_casts

        def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            tracer = self._tracer
            if tracer is not None:
                tracer.enter(op, args, kwargs)
            if op.transparent:
                return None
            if lowering is Lowering.AUTOCAST:
                ctx: AbstractContextManager[Any] = torch.autocast(device_type, dtype=dtype, cache_enabled=False)
                if own_params and casts.active:  # autocast finds the weights already low and leaves them be
                    stack = ExitStack()
                    stack.enter_context(ctx)
                    stack.enter_context(_reparametrize_module(
                        module, {n: casts.cast(qualified, p, dtype) for n, qualified, p in own_params}))
                    ctx = stack
                else:
                    ctx.__enter__()
                op.contexts.append(ctx)
                return None
            if lowering is Lowering.INPUT or lowering is Lowering.PARAMS:
                args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
                if params:
                    copies = {n: casts.cast(qualified, p, dtype) for n, qualified, p in params}
                    ctx = _reparametrize_module(module, copies)
                    ctx.__enter__()
                    op.contexts.append(ctx)
                return args, kwargs
            if lowering is Lowering.NONE and _has_low((args, kwargs)):
                to_fp32 = torch.float32
                return cast_floating(args, to_fp32, _LOW_DTYPES), cast_floating(kwargs, to_fp32, _LOW_DTYPES)
            return None

        return pre_hook

    def _make_post_hook(self, op: _Operator) -> Any:
        dtype = op.precision.dtype
        # an RNN's flat-weight list still points at the low copies once its parameters are swapped back
        rnn = op.module if op.lowering is Lowering.PARAMS and isinstance(op.module, nn.RNNBase) else None

        def post_hook(module: nn.Module, args: Any, output: Any) -> Any:
            if op.contexts:
                op.contexts.pop().__exit__(None, None, None)
                if rnn is not None:
                    rnn._update_flat_weights()
            if output is None and op.low:
                _note_failing_operator(op, self._device)  # always_call: forward raised, name the operator
            if op.low and not op.transparent and output is not None:
                if op.lowering is Lowering.OUTPUT:
                    output = cast_floating(output, dtype)
                tracer = self._tracer
                if tracer is not None and not any(t.dtype == dtype for t in _iter_tensors(output)):
                    tracer.ineffective.add(op.name)
                if op.name not in self._current_chained:
                    output = cast_floating(output, torch.float32, _LOW_DTYPES)
            tracer = self._tracer
            if tracer is not None:
                tracer.exit(op, output)
            return output

        return post_hook
