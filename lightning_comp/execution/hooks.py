"""The forward pre- and post-hook of one operator: the hot path of every step under a plan.

The pre-hook puts the operator's precision into effect the way its :class:`~lightning_comp.devices.lowering.Lowering`
says: it enters an autocast region (with the executor's own 16-bit weight copies for ``Linear``/``Conv``, so that
backward can re-cast them), casts the floating inputs, swaps the parameters for 16-bit copies for the call, sends an
fp8 ``Linear``'s matmul to float8 (:mod:`lightning_comp.execution.float8_calls`), or, for an FP32 operator, casts
16-bit inputs back to FP32 (and, where a ``master`` entry holds its parameters in bf16, swaps them for FP32 copies for
the call, re-cast in backward as the 16-bit ones are). It also enters the operator's saved-tensor hooks when its plan
entry saves in a lower precision. An operator whose plan entry saves ``recompute`` has both hooks wrapped by the
recomputer (:mod:`lightning_comp.execution.recompute`), which records each training-step call as a recipe; no other
operator's hooks do anything more for it. The post-hook leaves what the pre-hook entered and decides the output's
dtype: it stays low only where the step's cast boundaries (:mod:`lightning_comp.execution.cast_boundaries`) say
every consumer computes in the same precision; anywhere else it returns to FP32.

A ``FUNCTIONAL`` operator (a container computing between its children) is lowered by an autocast region around its
whole forward. Its children keep their own plan entries inside it: an autocast-lowered child enters a region of its
own precision, and every other child operator (FP32 ones, norms lowered by an input cast, ...) turns autocast off for
its own call while such a region is open, so the container's precision never reaches into them.

When the forward raises, the post-hook adds a note to the exception naming the operator, its precision and the
device, and, only where precision can be the cause, that assigning the operator FP32 may help: an out-of-range
token index raises the same ``IndexError`` in FP32 as in BF16, and advising FP32 there would send the user the wrong
way. The advice is given when the error speaks of dtypes or of the low-precision kernels (mixed dtypes, a missing
16-bit kernel, oneDNN's primitive descriptors, float8); otherwise the note says that the error may not come from
precision, and how to tell.

Parameters are read from the module at every call, never remembered: a deep copy of the model (an EMA or teacher
model) computes with its own weights, and parameters replaced on the same module (``load_state_dict(assign=True)``,
a sharded strategy swapping shards and full tensors around every forward) are the ones used and trained.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_comp.adapters.torch_internals import reparametrized, update_rnn_flat_weights
from lightning_comp.common.nested import cast_floating, has_dtype
from lightning_comp.devices.device_classes import device_class
from lightning_comp.devices.lowering import Lowering
from lightning_comp.execution.cast_boundaries import LOW_DTYPES, ConsumerTracer
from lightning_comp.execution.compiled_regions import compiling, enter_autocast, exit_autocast, only_inlined
from lightning_comp.execution.float8_calls import Float8Calls
from lightning_comp.execution.recompute import Recomputer
from lightning_comp.execution.saved_tensors import SavedTensorCompressor
from lightning_comp.execution.upcast_saving import UpcastSaver
from lightning_comp.execution.weight_casts import WeightCastRecorder
from lightning_comp.numerics.precision import ComputePrecision, SavedPrecision
from lightning_comp.operators.kinds import OperatorKind, is_recurrent, weight_reading

__all__ = ["HookedOperator", "StepState", "make_hooks", "note_failing_operator", "precision_may_cause"]

@dataclass(eq=False)
class HookedOperator:
    """One hooked operator: what it computes in, how that is put into effect, what it saves in.

    Attributes:
        name: the operator's name in the plan.
        module: the module.
        kind: what it does.
        precision: the precision the plan assigns it.
        lowering: how that precision is put into effect on the device (``NONE``: it computes in FP32).
        saved: the precision it stores its saved tensors in, or ``recompute``: its outputs are recomputed in backward
            wherever they are saved.
        contexts: the contexts its pre-hook entered, left by its post-hook (a stack: a module may call itself).
        shields: the autocast-off regions its pre-hook entered inside an enclosing ``FUNCTIONAL`` region.
        provisional: a container hooked for a tracing step only (it may turn out to compute nothing itself).
        fp32_copies: it computes in FP32 and reads parameters a ``master`` entry holds in bf16 (its own, or one tied
            to another operator's): its forward runs with FP32 copies of them (saved for backward as recipes, like a
            lowered operator's 16-bit copies).
    """

    name: str
    module: nn.Module
    kind: OperatorKind
    precision: ComputePrecision
    lowering: Lowering
    saved: SavedPrecision = SavedPrecision.FP32
    contexts: list[AbstractContextManager[Any]] = field(default_factory=list)
    shields: list[Any] = field(default_factory=list)
    provisional: bool = False
    fp32_copies: bool = False

    @property
    def low(self) -> bool:
        """Whether it computes in a 16-bit precision."""
        return self.lowering is not Lowering.NONE

    @property
    def transparent(self) -> bool:
        """Whether it only reshapes (its output has its input's dtype, whatever the plan says)."""
        return self.kind is OperatorKind.SHAPE


PreHook = Callable[[nn.Module, Any, Any], Any]
PostHook = Callable[[nn.Module, Any, Any], Any]


@dataclass
class StepState:
    """What the hooks read of the step that runs now; the executor sets it at each step's start and end.

    Attributes:
        tracer: the consumer tracer of a calibrating step (``None`` in every other step).
        chained: the low operators whose outputs stay low in this step.
        device: the device the hooks were built for (for error notes).
        regions: how many ``FUNCTIONAL`` operators' autocast regions are open now (child operators shield their own
            call from them).
        upcasts: where post-hooks note the FP32 copies they make of low outputs (``None``: nowhere).
    """

    tracer: ConsumerTracer | None = None
    chained: frozenset[str] = frozenset()
    device: torch.device | None = field(default=None)
    regions: int = 0
    upcasts: UpcastSaver | None = None


def make_hooks(op: HookedOperator, state: StepState, casts: WeightCastRecorder,
               compressor: SavedTensorCompressor, recomputer: Recomputer | None = None) -> tuple[PreHook, PostHook]:
    """The pre-hook (with kwargs) and the post-hook (``always_call``) that run ``op`` in its planned precision.

    Args:
        op: the operator.
        state: the step's state, read at every call.
        casts: makes the 16-bit weight copies (and, while a step records, saves them as recipes).
        compressor: makes the saved-tensor hooks of a lower saved precision.
        recomputer: wraps the hooks of an operator that saves ``recompute`` (required for one).
    """
    assert state.device is not None
    pre_hook, post_hook = _pre_hook(op, state, casts, compressor, state.device.type), _post_hook(op, state)
    if op.saved.recomputes:
        assert recomputer is not None, "an operator saving 'recompute' needs the executor's recomputer"
        return recomputer.wrap(op, pre_hook, post_hook)
    return pre_hook, post_hook


def _pre_hook(op: HookedOperator, state: StepState, casts: WeightCastRecorder, compressor: SavedTensorCompressor,
              device_type: str) -> PreHook:
    dtype = op.precision.dtype
    lowering = op.lowering
    prefix = f"{op.name}." if op.name else ""  # qualified parameter names, for messages
    # Linear/Conv-like operators get their 16-bit weight copies from the executor (so they can be re-cast in backward
    # instead of kept); other autocast-lowered modules are left to autocast.
    recast_own = lowering is Lowering.AUTOCAST and weight_reading(op.module)
    saved = op.saved
    region = op.kind is OperatorKind.FUNCTIONAL and lowering is Lowering.AUTOCAST  # the container's own work
    shields = not op.transparent and lowering is not Lowering.AUTOCAST  # from an enclosing container's region
    recipe = op.precision.fp8_recipe if lowering is Lowering.FLOAT8 else ""

    def copies_of(module: nn.Module, recurse: bool, to: torch.dtype,
                  only: tuple[torch.dtype, ...] | None = None) -> dict[str, torch.Tensor]:
        # ``to`` copies of the parameters of the module being called (those of a dtype in ``only``), as they are now
        # (see the module docstring)
        return {n: casts.cast(prefix + n, p, to) for n, p in module.named_parameters(recurse=recurse)
                if only is None or p.dtype in only}

    # An FP32 operator reading parameters a bf16 master holds: FP32 copies of those it reads itself (a container's own
    # parameters only: its children are operators with plan entries of their own).
    fp32_copies, recurse_own = op.fp32_copies and lowering is Lowering.NONE, op.kind is not OperatorKind.FUNCTIONAL

    def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
        tracer = state.tracer
        if tracer is not None:
            tracer.enter(op, args, kwargs)
        if op.transparent:
            return None
        if region:
            state.regions += 1
        if lowering is Lowering.AUTOCAST and compiling():  # a region Dynamo traces into the graph
            op.contexts.append(enter_autocast(device_type, dtype))
            return None
        contexts: list[AbstractContextManager[Any]] = []  # entered now, left in the post-hook
        result = None
        if shields and state.regions:  # one entry per call while a region is open (None: autocast is off anyway)
            op.shields.append(_Shield(device_type) if torch.is_autocast_enabled(device_type) else None)
        copies: dict[str, torch.Tensor] = {}
        if lowering is Lowering.AUTOCAST:
            contexts.append(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
            if recast_own and casts.active:  # autocast finds the weights already low and leaves them be
                copies = copies_of(module, False, dtype)
                contexts.append(reparametrized(module, copies))
        elif lowering is Lowering.FLOAT8:  # its F.linear computed with float8 operands, bf16 in and out
            contexts.append(Float8Calls(op.name, module, recipe, dtype))
        elif lowering is Lowering.INPUT or lowering is Lowering.PARAMS:
            args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
            copies = copies_of(module, True, dtype) if lowering is Lowering.PARAMS else {}
            if copies:
                contexts.append(reparametrized(module, copies))
            result = args, kwargs
        elif lowering is Lowering.NONE:
            if has_dtype(args, LOW_DTYPES) or (kwargs and has_dtype(kwargs, LOW_DTYPES)):
                # (args and kwargs walked apart: each is a flat structure the walker takes on its fast path)
                result = (cast_floating(args, torch.float32, LOW_DTYPES),
                          cast_floating(kwargs, torch.float32, LOW_DTYPES))
            if fp32_copies:
                copies = copies_of(module, recurse_own, torch.float32, LOW_DTYPES)
                if copies:
                    contexts.append(reparametrized(module, copies))
        if copies:  # its weight copies are saved as recipes (outside the compressor: it hands them on)
            saving = casts.saving()
            if saving is not None:
                contexts.append(saving)
        if saved.compresses:
            hooks = compressor.context(saved, op.name)
            if hooks is not None:
                contexts.append(hooks)
        if contexts:
            _enter(op, contexts)
        return result

    return only_inlined(pre_hook)


class _Shield:
    """An autocast-off region entered by a pre-hook and left by the post-hook (traced into compiled graphs)."""

    def __init__(self, device_type: str) -> None:
        self.mode = enter_autocast(device_type, torch.bfloat16, enabled=False)  # (a dtype autocast accepts)

    def exit(self) -> None:
        exit_autocast(self.mode)


def _enter(op: HookedOperator, contexts: list[AbstractContextManager[Any]]) -> None:
    """Enter ``contexts`` and push what the post-hook must leave (one context as it is, several in an ExitStack)."""
    if len(contexts) == 1:
        contexts[0].__enter__()
        op.contexts.append(contexts[0])
        return
    stack = ExitStack()
    for context in contexts:
        stack.enter_context(context)
    op.contexts.append(stack)


def _post_hook(op: HookedOperator, state: StepState) -> PostHook:
    dtype = op.precision.dtype
    # an RNN's flat-weight list still points at the copies once its parameters are swapped back
    rnn = (op.lowering is Lowering.PARAMS or op.fp32_copies) and is_recurrent(op.module)
    functional_region = op.lowering is Lowering.AUTOCAST
    region = op.kind is OperatorKind.FUNCTIONAL and functional_region
    shields = not op.transparent and not functional_region

    def post_hook(module: nn.Module, args: Any, output: Any) -> Any:
        if region:
            state.regions -= 1
        if functional_region and op.contexts and compiling():
            exit_autocast(op.contexts.pop())
        elif op.contexts:
            op.contexts.pop().__exit__(None, None, None)
            if rnn and is_recurrent(module):
                update_rnn_flat_weights(module)
        if shields and state.regions and op.shields:
            shield = op.shields.pop()
            if shield is not None:
                shield.exit()
        if output is None and (op.low or op.saved.changes):  # always_call: forward raised, name the operator
            note_failing_operator(op, sys.exc_info()[1], state.device)
        tracer = state.tracer
        if op.low and not op.transparent and output is not None:
            if op.lowering is Lowering.OUTPUT:
                output = cast_floating(output, dtype)
            if tracer is not None and not tracer.had_effect(op, output):
                tracer.ineffective.add(op.name)
            if op.name not in state.chained:
                low_output = output
                output = cast_floating(output, torch.float32, LOW_DTYPES)
                if state.upcasts is not None:
                    state.upcasts.note(low_output, output)
        if tracer is not None:
            tracer.exit(op, output)
        return output

    return only_inlined(post_hook)


# Words of errors that mixed or 16-bit dtypes cause (torch's dtype names and messages, oneDNN's, CUDA kernels')
_PRECISION_WORDS = re.compile(
    r"dtype|scalar type|bfloat16|BFloat16|float16|\bHalf\b|\bhalf\b|float8|Float8|\bbf16\b|\bfp16\b|\bfp8\b"
    r"|mat1 and mat2|same type|primitive descriptor|not implemented for|mkldnn|oneDNN|onednn|overflow"
    r"|autocast",  # CUDA autocast refuses some ops outright (binary_cross_entropy: "unsafe to autocast")
)


def precision_may_cause(error: BaseException) -> bool:
    """Whether ``error``'s message speaks of dtypes or 16-bit kernels, so that a lower precision may have caused it."""
    return bool(_PRECISION_WORDS.search(str(error)))


def note_failing_operator(op: HookedOperator, error: BaseException | None, device: torch.device | None) -> None:
    """Add a note to ``error`` (raised inside ``op``'s forward) naming the operator, its precision and the device;
    only the innermost lowered operator notes it, once."""
    if error is None or getattr(error, "_comp_operator", None) is not None or not hasattr(error, "add_note") \
            or op.provisional:  # a container being traced: the operator inside it, if any, notes the error
        return
    error._comp_operator = op.name  # type: ignore[attr-defined]
    where = "unknown device" if device is None else f"{device} [{device_class(device).describe()}]"
    saving = (", recomputing its output in backward" if op.saved.recomputes
              else f", saving for backward in {op.saved.value}" if op.saved.compresses else "")
    if precision_may_cause(error):
        advice = (" Assign it 'fp32' in the plan, or exclude it from the search with CoMPSearch(exclude=[...]).")
    else:
        advice = (" The error does not speak of dtypes, so it may not come from precision: the same input would"
                  " likely fail in fp32 too. To tell, assign the operator 'fp32' in the plan and run again.")
    error.add_note(
        f"lightning-comp: raised inside operator {op.name or '<root>'!r} ({type(op.module).__name__}) computing in"
        f" {op.precision.value} ({op.lowering.value} lowering){saving} on {where}.{advice}"
    )
