"""Cast boundaries: where a low-precision operator's output may stay low, found by tracing one step.

A low-precision operator's output stays in the low dtype only where every consumer of it is an operator of the same
low precision; anywhere else (an FP32 operator, a functional op outside any operator, the loss, the caller) it is
cast back to FP32. :class:`ConsumerTracer` finds the consumers during the first step of each kind after a plan is
applied, with a ``TorchFunctionMode`` that sees every torch call made outside operators.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_comp.devices.device_class import device_class
from lightning_comp.numerics.precision import Precision
from lightning_comp.numerics.saved_precision import SavedPrecision
from lightning_comp.operators.discovery import Lowering, OperatorKind

__all__ = ["ConsumerTracer", "HookedOperator", "LOW_DTYPES", "StepKind", "cast_floating", "has_low", "iter_tensors",
           "note_failing_operator"]

LOW_DTYPES = (torch.bfloat16, torch.float16)
# Tensor metadata reads that neither consume values nor create tensors: they never force a cast boundary.
_METADATA_GETTERS = frozenset({"shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "grad_fn",
                               "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "grad", "_version"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "is_floating_point",
                               "element_size", "__len__", "data_ptr", "get_device", "__repr__", "__format__",
                               "storage_offset", "nelement", "ndimension", "is_complex"})


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


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_tensors(o)


def has_low(obj: Any) -> bool:
    return any(t.dtype in LOW_DTYPES for t in iter_tensors(obj))


@dataclass(eq=False)
class HookedOperator:
    """Run-time state of one hooked operator."""

    name: str
    module: nn.Module
    kind: OperatorKind
    precision: Precision
    lowering: Lowering
    contexts: list[AbstractContextManager[Any]] = field(default_factory=list)
    saved: SavedPrecision = SavedPrecision.FP32

    @property
    def low(self) -> bool:
        return self.lowering is not Lowering.NONE

    @property
    def transparent(self) -> bool:
        return self.kind is OperatorKind.SHAPE


class StepKind(str, Enum):
    """The kind of Lightning step a forward belongs to; cast boundaries are calibrated per kind."""

    TRAIN = "train"
    VALIDATION = "validation"
    TEST = "test"
    PREDICT = "predict"


def note_failing_operator(op: HookedOperator, device: torch.device | None) -> None:
    """Add to an exception raised inside a lowered operator which operator, precision and device it was."""
    error = sys.exc_info()[1]
    if error is None or getattr(error, "_comp_operator", None) is not None or not hasattr(error, "add_note"):
        return
    error._comp_operator = op.name  # type: ignore[attr-defined]  # the innermost operator notes it, once
    where = "unknown device" if device is None else f"{device} [{device_class(device).describe()}]"
    saving = f", saving for backward in {op.saved.value}" if op.saved.compresses else ""
    error.add_note(
        f"lightning-comp: raised inside operator {op.name or '<root>'!r} ({type(op.module).__name__}) computing in"
        f" {op.precision.value} ({op.lowering.value} lowering){saving} on {where}. Assign it 'fp32' in the plan,"
        " or exclude it from the search with CoMPSearch(exclude=[...])."
    )


class ConsumerTracer(TorchFunctionMode):
    """Records, for one step, which operators consume each low-precision operator's output."""

    def __init__(self, operators: dict[str, HookedOperator]) -> None:
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
            for tensor in iter_tensors((args, kwargs)):
                if self._known(tensor):
                    self.escaped.update(self.producers[id(tensor)])
                    self.unused_calls.discard(self.call_of[id(tensor)])
        return func(*args, **kwargs)

    def enter(self, op: HookedOperator, args: Any, kwargs: Any) -> None:
        self.depth += 1
        sources: set[str] = set()
        for tensor in iter_tensors((args, kwargs)):
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

    def exit(self, op: HookedOperator, output: Any) -> None:
        sources = self.pending.pop() if self.pending else frozenset()
        attributed = sources if op.transparent else (frozenset({op.name}) if op.low else frozenset())
        if attributed:
            call = len(self.call_names)
            self.call_names.append(attributed)
            self.unused_calls.add(call)
            for tensor in iter_tensors(output):
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


def _is_metadata(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_GETTERS
    return name in _METADATA_METHODS
