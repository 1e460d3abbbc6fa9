"""The recompute hooks of a training step, and the step's state while a recipe is re-run: :class:`Recomputer`.

- :meth:`Recomputer.recording` puts one pair of :func:`torch.autograd.graph.saved_tensors_hooks` in force for a
  training step's forward (inside whatever the user or a profiler has in force: what it does not handle it hands on
  to those hooks, as :mod:`lightning_comp.execution.saved_tensors` does). Its pack hook stores a reference to the
  recipe of each tensor it recognises (:mod:`lightning_comp.execution.recompute.recognition`).
- :meth:`Recomputer.wrap` wraps a recompute operator X's pre- and post-hook. The pre-hook opens a record of the call
  (the inputs after its casts, what reproduces the forward: :mod:`lightning_comp.execution.recompute.forward_state`);
  while X's forward runs, a non-leaf tensor saved inside it (other than X's inputs) is packed as a placeholder
  (:class:`~lightning_comp.execution.recompute.saved.Pending`). X's post-hook makes the call's
  :class:`~lightning_comp.execution.recompute.recipe.Recipe`, turns each placeholder whose tensor is (a view of) one
  of X's outputs into a reference to it, hands every other one on to the outer hooks (or to an enclosing recompute
  operator's post-hook), and records the outputs. An input of X that is itself a recorded output (or a cast of one)
  is held as that output's recipe. A compressing operator (``bf16``/``fp8``) hands what the recompute hooks claim
  (:meth:`Recomputer.claims`, casts included) on uncompressed: the recipe wins.
- While a recipe is re-run in backward (:meth:`Recomputer._recomputing`) the step's state is as it was in that
  forward (chained operators, open functional regions), and no step bookkeeping happens: weight-cast recording and
  saved-tensor hooks find nothing to save under ``no_grad``, the consumer tracer of a calibrating step is silenced
  (the recomputer's own reads of tensors in the step are too), and the wrapped hooks make no recipe; X's post-hook
  hands the re-run's outputs to the recipe instead.

An operator whose output is not a tensor or a tuple/list of tensors, or that modifies its own input in place, raises
:class:`~lightning_comp.errors.PlanError` at its first training step. X's hooks inside saved-tensor hooks that were
entered within the step (``torch.utils.checkpoint``'s, ``save_on_cpu`` entered in ``training_step``) leave X to those
hooks, and say so once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_comp.adapters.torch_internals import storage_key, tensor_version, top_saved_tensors_hooks
from lightning_comp.common.nested import map_tensors, tensors
from lightning_comp.errors import PlanError
from lightning_comp.execution.recompute.forward_state import AutocastState, RngState, autocast_state, buffer_copies
from lightning_comp.execution.recompute.recipe import (
    FINAL,
    KEEP_AS_COMPUTED,
    RAW,
    Derived,
    Held,
    OutputMeta,
    Recipe,
    RecomputedOperator,
    describe,
    outputs_of,
)
from lightning_comp.execution.recompute.recognition import RecordedOutputs, match_in_forward
from lightning_comp.execution.recompute.saved import Pending, Saved, timed_unpack, unpack
from lightning_comp.execution.saved_hooks import HookTimer, OuterHooks, hooks_installable
from lightning_comp.execution.saved_tensors import is_compressor_pack
from lightning_comp.numerics.precision import ComputePrecision

__all__ = ["Hook", "Recomputer"]

Hook = Callable[[nn.Module, Any, Any], Any]


class _StepState(Protocol):
    """What the recomputer reads and sets of the step's state (:class:`~lightning_comp.execution.hooks.StepState`)."""

    tracer: Any
    chained: frozenset[str]
    regions: int
    device: torch.device | None
    upcasts: Any  # an UpcastSaver, or None


@dataclass(frozen=True)
class _Silent:
    """A shape-only operator pushed onto a calibrating step's consumer tracer while a forward is recomputed: calls
    inside a transparent operator consume nothing, so the recomputation leaves the cast boundaries as they are."""

    name: str = "<recompute>"
    precision: ComputePrecision = ComputePrecision.FP32
    low: bool = False
    transparent: bool = True


_SILENT = _Silent()


class _Unseen:
    """Inside: the calibrating step's consumer tracer (if one runs) sees the recomputer's own tensor reads (a view's
    base, a storage) as made by a shape-only operator, so they decide no cast boundary."""

    __slots__ = ("state", "tracers")

    def __init__(self, state: _StepState) -> None:
        self.state = state
        self.tracers: list[Any] = []  # (re-entrant)

    def __enter__(self) -> None:
        tracer = self.state.tracer
        self.tracers.append(tracer)
        if tracer is not None:
            tracer.open.append(_SILENT)

    def __exit__(self, *exc: Any) -> None:
        tracer = self.tracers.pop()
        if tracer is not None and tracer.open and tracer.open[-1] is _SILENT:
            tracer.open.pop()


@dataclass
class _Call:
    """One call of a recompute operator in a step, from its pre-hook to its post-hook."""

    op: RecomputedOperator
    autocast: AutocastState
    regions: int
    rng: RngState | None = None  # (set once the pre-hook has cast the inputs)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    args: Any = ()
    kwargs: Any = None
    inputs: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    input_ids: frozenset[int] = frozenset()
    pending: list[Pending] = field(default_factory=list)


class Recomputer:
    """Stores recipes instead of recompute operators' outputs in training steps (see the module docstring).

    Args:
        state: the step's state, read when a forward is recorded and set while it is recomputed.
    """

    def __init__(self, state: _StepState) -> None:
        self._state = state
        self._recording = False
        self._outer: OuterHooks | None = None  # the hooks in force around the step being recorded
        self._recorded = RecordedOutputs()  # the outputs of the recipes recorded in the step
        self._calls: list[_Call | None] = []  # one per hooked call in flight (None: not recorded)
        self._open_calls: list[_Call] = []  # the recorded ones, innermost last
        self._recomputed: Recipe | None = None  # the recipe being recomputed now
        self._pack_hook: Callable[[torch.Tensor], Any] | None = None
        self._warned: set[str] = set()
        self._unseen = _Unseen(state)
        #: Set by a measurement for the steps it times: entered around each backward unpack that re-runs (or reads the
        #: re-run of) a recompute operator's forward, with that operator's name; read when a step's forward starts.
        self.unpack_timer: HookTimer | None = None

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the plugin: recipes and weak tables belong to this process
        return {**self.__dict__, "_recorded": None, "_calls": [], "_open_calls": [], "_unseen": None,
                "_recomputed": None, "_pack_hook": None, "_recording": False, "_outer": None,
                "unpack_timer": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._recorded = RecordedOutputs()
        self._unseen = _Unseen(self._state)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The context of a training step's forward in which recipes are made (a no-op where autograd records
        nothing, and inside another recording)."""
        if self._recording or not hooks_installable():
            yield
            return
        self._outer = OuterHooks()
        pack = self._pack_hook = self._pack  # (one bound method: the innermost-hooks test compares it)
        self._recording = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack if self.unpack_timer is None
                                                          else timed_unpack(self.unpack_timer)):
                yield
        finally:
            self._recording = False
            self._pack_hook = self._outer = None
            self._recorded = RecordedOutputs()
            self._calls.clear()
            self._open_calls.clear()

    # ------------------------------------------------------------------------------------------ saved tensors
    def claims(self, tensor: torch.Tensor) -> bool:
        """Whether the recompute hooks will store ``tensor`` as a recipe (or may: it is saved inside a recompute
        operator's forward before its output exists); a compressing operator then hands it on uncompressed."""
        if not self._recording:
            return False
        with self._unseen:
            if self._recorded.find(tensor) is not None:
                return True
        return bool(self._open_calls) and not tensor.is_leaf and id(tensor) not in self._open_calls[-1].input_ids

    def _pack(self, tensor: torch.Tensor) -> Any:
        outer = self._outer
        assert outer is not None
        with self._unseen:
            found = self._recorded.find(tensor)
        if found is not None:
            return Saved(*found)
        if self._open_calls and not tensor.is_leaf:
            call = self._open_calls[-1]
            if id(tensor) not in call.input_ids:
                pending = Pending(tensor, outer)
                call.pending.append(pending)
                return pending
        return outer.hand_on(tensor)

    def _held(self, tensor: torch.Tensor) -> Held | Derived:
        found = self._recorded.find(tensor)
        if found is not None:
            return Derived(*found)
        upcasts = self._state.upcasts
        low = None if upcasts is None else upcasts.source(tensor)
        if low is not None:  # an FP32 copy of a lowered output: its source, cast again, is the same input
            return Held(low, tensor_version(low), tensor.dtype)
        return Held(tensor, tensor_version(tensor))

    # -------------------------------------------------------------------------------------------------- hooks
    def wrap(self, op: RecomputedOperator, pre_hook: Hook, post_hook: Hook) -> tuple[Hook, Hook]:
        """The pre-hook (with kwargs) and post-hook of recompute operator ``op``: ``pre_hook``/``post_hook`` with the
        recipe bookkeeping around them."""
        state = self._state

        def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if not self._recording or self._recomputed is not None or not torch.is_grad_enabled():
                self._calls.append(None)
                return pre_hook(module, args, kwargs)
            if not self._innermost():
                self._say_left_to_outer_hooks(op)
                self._calls.append(None)
                return pre_hook(module, args, kwargs)
            call = _Call(op, autocast_state(state.device), state.regions)
            self._calls.append(call)  # (first: the post-hook runs even if a pre-hook raises)
            with self._unseen:
                call.buffers = buffer_copies(module)  # (kernels update some unversioned)
            result = pre_hook(module, args, kwargs)
            with self._unseen:
                call.args, call.kwargs = result if result is not None else (args, kwargs)
                call.inputs = tensors((call.args, call.kwargs))
                call.versions = [tensor_version(t) for t in call.inputs]
                call.input_ids = frozenset(id(t) for t in call.inputs)
                call.rng = RngState.capture(call.inputs)
            self._open_calls.append(call)
            return result

        def post(module: nn.Module, args: Any, output: Any) -> Any:
            call = self._calls.pop() if self._calls else None
            if call is not None and self._open_calls and self._open_calls[-1] is call:
                self._open_calls.pop()
            raw = output
            final = post_hook(module, args, output)
            target = self._recomputed
            if target is not None and target.op.module is module and raw is not None:
                target.captured = (outputs_of(op, raw), outputs_of(op, final))
            if call is not None and (raw is not None or sys.exc_info()[1] is None):  # (None: the forward raised)
                with self._unseen:
                    self._finish(call, raw, final)
            return final

        return pre, post

    def _innermost(self) -> bool:
        """Whether the saved-tensor hooks in force are this step's recompute hooks, or a compressing operator's
        (which hands on to them): not hooks entered within the step by someone else."""
        top = top_saved_tensors_hooks()
        return top is not None and (top[0] is self._pack_hook or is_compressor_pack(top[0]))

    def _say_left_to_outer_hooks(self, op: RecomputedOperator) -> None:
        if op.name in self._warned:
            return
        self._warned.add(op.name)
        rank_zero_warn(
            f"Operator {describe(op)} saves 'recompute', but it ran inside saved-tensor hooks entered within the"
            " training step (torch.utils.checkpoint's, save_on_cpu or a profiler's entered in training_step): those"
            " hooks decide how its output is kept there, and it is not recomputed by lightning-comp. Enter them"
            " around the whole step, or keep the operator's saved precision as computed ('fp32').",
            stacklevel=2,
        )

    def _finish(self, call: _Call, raw: Any, final: Any) -> None:
        """At the post-hook of a recorded call: make its recipe, resolve its placeholders, register its outputs."""
        op = call.op
        raw_outs, final_outs = outputs_of(op, raw), outputs_of(op, final)
        for tensor, version in zip(call.inputs, call.versions):
            if tensor_version(tensor) != version:
                raise PlanError(
                    f"Operator {describe(op)} saves 'recompute', but its forward modifies its input in place, so"
                    f" the input its output would be recomputed from is gone. {KEEP_AS_COMPUTED}, or make it work"
                    " out of place (inplace=False)."
                )
        inputs = {storage_key(t) for t in call.inputs}
        metas: tuple[list[OutputMeta | None], list[OutputMeta | None]] = (
            [None if t is None or storage_key(t) in inputs else OutputMeta.of(t) for t in raw_outs],
            [None if t is None or storage_key(t) in inputs else OutputMeta.of(t) for t in final_outs],
        )  # an output sharing an input's memory is kept with that input anyway
        held = map_tensors((call.args, call.kwargs), self._held)
        recipe = Recipe(self._recomputing, op, held[0], held[1], self._state.chained, call.regions, call.autocast,
                        call.rng, call.buffers, metas)
        stages = ((RAW, raw_outs), (FINAL, final_outs))
        for pending in call.pending:
            assert pending.tensor is not None
            found = match_in_forward(pending.tensor, pending.version, stages, metas)
            if found is not None:
                pending.resolve(Saved(recipe, *found))
            elif self._open_calls:  # it may be an output of the enclosing recompute operator
                self._open_calls[-1].pending.append(pending)
            else:
                pending.resolve(None)
        call.pending.clear()
        for index, (out, meta) in enumerate(zip(final_outs, metas[FINAL])):
            if out is not None and meta is not None:
                self._recorded.add(recipe, index, out)

    @contextmanager
    def _recomputing(self, recipe: Recipe) -> Iterator[None]:
        """While ``recipe``'s forward is recomputed: the step's state as it was in that forward, no bookkeeping."""
        state = self._state
        saved = self._recomputed, state.chained, state.regions
        with _Unseen(state):
            tracer, state.tracer = state.tracer, None
            self._recomputed, state.chained, state.regions = recipe, recipe.chained, recipe.regions
            try:
                yield
            finally:
                self._recomputed, state.chained, state.regions = saved
                state.tracer = tracer
