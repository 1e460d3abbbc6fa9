"""Cast boundaries: where a low-precision operator's output may stay low, found by tracing one step.

A low-precision operator's output stays in the low dtype only where every consumer of it is an operator computing in
that dtype (bf16 and fp8 operators both take bf16 activations); anywhere else (an FP32 operator, a functional op
outside any operator, the loss, the caller) it is cast back to FP32. :class:`ConsumerTracer` finds the consumers
during the first step of each kind after a plan is applied, with a ``TorchFunctionMode`` that sees every torch call.
A call consumes for the innermost operator whose forward runs it: for a ``FUNCTIONAL`` operator (a container
computing between its children) that is its own work, so a child's output consumed there stays low only if the
container computes in the child's precision.

Containers that a step's trace is still examining (*provisional* operators, hooked for the first step only) consume
as if they were no operator at all, and are never producers: the cast boundaries they give are conservative (an
output may be cast back to FP32 where it could have stayed low), never wrong, whichever of them turn out to compute.

Activations and products outside every operator between lowered operators (a gated MLP's ``silu(fc_1(x)) *
fc_2(x)`` in its container's own forward: litgpt's ``LLaMAMLP``, Hugging Face's Llama MLP) carry their inputs'
producers on too, where every floating input is such an output of one low dtype: the producers stay low only if the
result reaches operators of their precision (or more such code) and nothing else, and then that code computes in the
low dtype, as autocast leaves it. A call with any other floating input (an FP32 tensor), an in-place call, a sum (a
residual stream: summed in 16 bits it would lose the small updates) and any function autocast runs in FP32 or that
reduces (``exp``, ``softmax``, ``sum``) consume as before.

The same step finds plan entries that had no effect: a low operator none of whose torch calls (casts aside) returned
a tensor of its low dtype. Its output's dtype alone would not tell: under CUDA autocast a region whose last op is on
the FP32 list (``layer_norm``, ``softmax``, most losses) returns FP32 after its matmuls ran in 16 bits.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from lightning_comp.common.nested import tensors
from lightning_comp.numerics.precision import ComputePrecision

__all__ = ["LOW_DTYPES", "ConsumerTracer", "TracedOperator"]

LOW_DTYPES = (torch.bfloat16, torch.float16)
# Tensor metadata reads that neither consume values nor create tensors: they never force a cast boundary.
_METADATA_GETTERS = frozenset({"shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "grad_fn",
                               "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "grad", "_version"})
# Calls that only convert (the hooks' own input and weight casts among them): a low dtype out of them is no work.
_CONVERSIONS = frozenset({"to", "type", "bfloat16", "half", "float", "double", "_to_copy", "clone", "detach",
                          "contiguous", "copy_", "__get__"})
# Calls that only re-view their input (what a container does between a projection and attention: split heads,
# permute, unbind): their outputs carry the producers of their input on instead of consuming it, so a lowered
# output stays low through them into a consumer of its precision (and is cast where such a view is consumed
# elsewhere, by the producer, as before).
_VIEWS = frozenset({"view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "unbind", "split",
                    "split_with_sizes", "chunk", "tensor_split", "squeeze", "unsqueeze", "flatten", "unflatten",
                    "expand", "expand_as", "narrow", "select", "__getitem__", "contiguous", "movedim", "moveaxis",
                    "swapaxes", "swapdims"})
# Elementwise functions whose output has its inputs' dtype and that autocast runs in its inputs' dtype on every
# device (in neither its FP32 nor its promote lists): between lowered operators they carry their inputs' producers on.
# Sums are not among them: a residual stream (``x + block(x)``) summed in 16 bits loses the small updates, so a sum
# outside every operator consumes its inputs (they return to FP32 before it) whatever its neighbours compute in.
_ELEMENTWISE = frozenset({"mul", "neg", "__mul__", "__rmul__", "__neg__", "__truediv__", "silu", "gelu", "relu",
                          "leaky_relu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "mish", "elu", "selu", "celu",
                          "glu", "dropout"})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "is_floating_point",
                               "element_size", "__len__", "data_ptr", "get_device", "__repr__", "__format__",
                               "storage_offset", "nelement", "ndimension", "is_complex",
                               # gradient hooks (a profiler's, a user's): they read no values now
                               "register_hook", "register_post_accumulate_grad_hook", "retain_grad"})


class TracedOperator(Protocol):
    """What the tracer reads of a hooked operator."""

    @property
    def name(self) -> str: ...

    @property
    def precision(self) -> ComputePrecision: ...

    @property
    def low(self) -> bool: ...

    @property
    def transparent(self) -> bool: ...


class ConsumerTracer(TorchFunctionMode):
    """Records, for one step, which operators consume each low-precision operator's output."""

    def __init__(self, operators: Mapping[str, TracedOperator], provisional: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.operators = operators
        self.provisional = provisional
        # Keyed by id(); each entry keeps a weak reference so that an id reused by a new tensor after the old one
        # died is not mistaken for it. (Holding the outputs alive instead would keep every low activation of the
        # calibration step until its end: +150-200 MiB on a small GPT/CNN.)
        self.producers: dict[int, frozenset[str]] = {}
        self.refs: dict[int, weakref.ref[torch.Tensor]] = {}
        self.consumed: set[str] = set()
        self.escaped: set[str] = set()
        self.pending: list[frozenset[str]] = []
        self.together: set[frozenset[str]] = set()  # producers of one elementwise call: all stay low or none does
        self.ineffective: set[str] = set()
        self.open: list[TracedOperator] = []  # the operators whose forward runs now (innermost last)
        self.low_work: set[str] = set()  # low operators a call inside returned a tensor of their low dtype
        self.fed_low: set[str] = set()  # operators computing in FP32 that received a 16-bit floating input
        # Per call: the operators an output is attributed to, and which calls had no output used inside the step
        # (returned to the caller, e.g. from ``predict_step``): those must return in FP32 too.
        self.call_of: dict[int, int] = {}
        self.call_names: list[frozenset[str]] = []
        self.unused_calls: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.producers and getattr(func, "__name__", "") in _VIEWS:
            known = [t for t in tensors((args, kwargs)) if self._known(t)]
            if known:
                return self._view(func(*args, **kwargs), known)
        if self.producers and getattr(func, "__name__", "") in _ELEMENTWISE and self._outside_operators():
            carried = self._carried(args, kwargs)
            if carried is not None:
                return self._pass_on(func(*args, **kwargs), *carried)
        if self.producers and not _is_metadata(func):
            consumer = self._consumer()
            if consumer is None or not consumer.transparent:
                for tensor in tensors((args, kwargs)):
                    if self._known(tensor):
                        self.unused_calls.discard(self.call_of[id(tensor)])
                        for producer in self.producers[id(tensor)]:
                            if consumer is None or not (consumer.low and consumer.precision.dtype is
                                                        self.operators[producer].precision.dtype):
                                self.escaped.add(producer)
                            else:
                                self.consumed.add(producer)
        result = func(*args, **kwargs)
        if self.open:
            op = self.open[-1]
            if op.low and op.name not in self.low_work and getattr(func, "__name__", "") not in _CONVERSIONS \
                    and any(t.dtype == op.precision.dtype for t in tensors(result)):
                self.low_work.add(op.name)
        return result

    def _view(self, result: Any, inputs: list[torch.Tensor]) -> Any:
        """Attribute the outputs of a view of ``inputs`` to their producers (and their call: using the view uses it)."""
        sources = frozenset().union(*(self.producers[id(t)] for t in inputs))
        self._attribute(result, sources, self.call_of[id(inputs[0])])
        return result

    def _carried(self, args: Any, kwargs: Any) -> tuple[list[torch.Tensor], frozenset[str]] | None:
        """The floating inputs of an elementwise call outside every operator and their producers, where all of them
        are outputs of low operators of one dtype (the call then carries those producers on); else ``None``."""
        floating = [t for t in tensors((args, kwargs)) if t.is_floating_point()]
        if not floating or "out" in kwargs or kwargs.get("inplace") or not all(self._known(t) for t in floating):
            return None
        sources = frozenset().union(*(self.producers[id(t)] for t in floating))
        if len({self.operators[name].precision.dtype for name in sources}) != 1:
            return None  # outputs of two low dtypes: the call promotes to FP32, it consumes them
        return floating, sources

    def _pass_on(self, result: Any, inputs: list[torch.Tensor], sources: frozenset[str]) -> Any:
        """Attribute the outputs of an elementwise call on ``inputs`` to their producers, as a new call that uses
        theirs; the producers stay low together or not at all."""
        self.together.add(sources)
        for tensor in inputs:
            self.unused_calls.discard(self.call_of[id(tensor)])
        self._new_call(result, sources)
        return result

    def _outside_operators(self) -> bool:
        """Whether a call made now runs outside every operator (containers being traced are none yet)."""
        return all(op.name in self.provisional for op in self.open)

    def _consumer(self) -> TracedOperator | None:
        """The operator a call made now consumes for: the innermost open one (``None``: outside, or provisional)."""
        if not self.open:
            return None
        op = self.open[-1]
        return None if op.name in self.provisional else op

    def enter(self, op: TracedOperator, args: Any, kwargs: Any) -> None:
        self.open.append(op)
        provisional = op.name in self.provisional
        sources: set[str] = set()
        inputs = tensors((args, kwargs))
        if not op.low and not op.transparent and any(t.dtype in LOW_DTYPES for t in inputs):
            self.fed_low.add(op.name)
        for tensor in inputs:
            if not self._known(tensor):
                continue
            self.unused_calls.discard(self.call_of[id(tensor)])
            for producer in self.producers[id(tensor)]:
                sources.add(producer)
                self.consumed.add(producer)
                if op.transparent:
                    continue
                if provisional or not (op.low and op.precision.dtype is self.operators[producer].precision.dtype):
                    self.escaped.add(producer)
        self.pending.append(frozenset(sources))

    def exit(self, op: TracedOperator, output: Any) -> None:
        if self.open:
            self.open.pop()
        sources = self.pending.pop() if self.pending else frozenset()
        if op.name in self.provisional:
            attributed: frozenset[str] = frozenset()
        else:
            attributed = sources if op.transparent else (frozenset({op.name}) if op.low else frozenset())
        if attributed:
            self._new_call(output, attributed)

    def _new_call(self, output: Any, producers: frozenset[str]) -> None:
        """Attribute the tensors of ``output`` to ``producers`` as one new call, unused until something reads them."""
        call = len(self.call_names)
        self.call_names.append(producers)
        self.unused_calls.add(call)
        self._attribute(output, producers, call)

    def _attribute(self, output: Any, producers: frozenset[str], call: int) -> None:
        for tensor in tensors(output):
            self.producers[id(tensor)] = producers
            self.call_of[id(tensor)] = call
            self.refs[id(tensor)] = weakref.ref(tensor)

    def had_effect(self, op: TracedOperator, output: Any) -> bool:
        """Whether low operator ``op`` computed anything in its low dtype: its output is of that dtype, or a call
        inside its forward (casts aside) returned a tensor of it."""
        return op.name in self.low_work or any(t.dtype == op.precision.dtype for t in tensors(output))

    def _known(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is an output this tracer recorded (and not a new tensor that reuses a dead one's id)."""
        ref = self.refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def chained(self) -> frozenset[str]:
        """Low-precision operators whose output may stay in the low dtype."""
        returned = {name for call in self.unused_calls for name in self.call_names[call]}
        cast = self.escaped | returned
        spread = True
        while spread:  # an elementwise call computes low only if all its inputs stay low: one cast, all are
            spread = False
            for group in self.together:
                if cast & group and not group <= cast:
                    cast |= group
                    spread = True
        return frozenset(
            name for name, op in self.operators.items()
            if op.low and not op.transparent and name in self.consumed and name not in cast
        )


def _is_metadata(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_GETTERS
    return name in _METADATA_METHODS
