"""Recomputation instead of storage: operators whose plan entry saves ``"recompute"``.

An operator X saving ``recompute`` keeps none of its outputs for backward. Wherever autograd saves one of them (or a
view of one, or a cast of one: see below) in a training step, in any operator, in the model's own functional code,
or in X itself (ReLU, Sigmoid, Tanh and Softmax save their result), a *recipe* is stored instead: X, the inputs its
forward received (after the pre-hook's casts, held by reference: X itself typically saves them too, so they share its
storage), and what reproduces the forward: the RNG state (CPU, and that of every accelerator an input lives on, as
``torch.utils.checkpoint`` preserves it), the autocast state and functional-region depth around X, the step's cast
boundaries, and a copy of X's buffers as the forward found them. Backward unpacks the recipe by calling X again under
``torch.no_grad()``, through its hooks, so X computes in the precision it did in the step.

How the pieces fit:

- :meth:`Recomputer.recording` puts one pair of :func:`torch.autograd.graph.saved_tensors_hooks` in force for a
  training step's forward (inside whatever the user or a profiler has in force: what it does not handle it hands on
  to those hooks, as :mod:`lightning_comp.execution.saved_tensors` does). Its pack hook recognises the outputs of the
  recompute operators called so far (by identity, or as a view of one) and stores a reference to their recipe.
- It recognises *casts* of them too: a new tensor a consumer made of X's output with ``.to(dtype)``, an autocast
  region or its pre-hook's input cast (autograd node ``ToCopyBackward0`` whose single input is the node of one of X's
  recorded outputs, or of a reshape of one, ``ViewBackward0`` from ``Flatten``/``view``/``reshape``), of the same
  shape (element count through reshapes) and device, neither it nor the output modified in place since, and views
  of such a cast. What is stored is "recompute X's output, then cast it into a tensor of the cast's dtype and
  layout": the same conversion kernel on the same values, so bit-identical to the cast made in forward. This is what
  consumers save in the first (calibrating) step of a plan, where every lowered operator's output is handed on in
  FP32 and the next 16-bit operator casts it down again, and in any step where an FP32 recompute operator feeds a
  16-bit consumer; so a compressing consumer never stores a recompute output lossy in one step and recomputes it
  exactly in another (a resumed run's calibrating step is bit-identical to the uninterrupted run's calibrated one).
  The output is found from the cast's node through a weak reference: a cast saved after the output itself died
  (``act(h).to(torch.bfloat16)`` kept in a variable and saved later) is stored as it is, and so is a cast of any other
  view of it (a transpose, a slice) and a cast of an output that needs no gradient (it has no autograd node).
- :meth:`Recomputer.wrap` wraps X's pre- and post-hook. While X's forward runs its output does not exist yet, so a
  non-leaf tensor saved inside it (other than X's inputs) is packed as a *placeholder* holding the tensor; X's
  post-hook turns each placeholder whose tensor is (a view of) one of X's outputs into a reference to X's recipe,
  dropping the tensor, and hands every other one on to the outer hooks (or to an enclosing recompute operator's
  post-hook). A compressing operator (``bf16``/``fp8``) hands what the recompute hooks claim (casts included) on
  uncompressed: the recipe wins.
- An input of X that is itself the output of another recompute operator (or a cast of one: a bf16 ReLU's input cast
  from an FP32 BatchNorm's output) is held as that operator's recipe: in a chain such as BatchNorm -> ReLU -> Conv
  with both recomputed, only BatchNorm's input stays stored.
- A recomputed output is cached for as long as a reference saved for it is alive (autograd drops each reference once
  its node ran), so a LayerNorm output read by three projections is computed once per backward and freed after the
  last of them; a recipe needed only as another recipe's input is computed and dropped.
- The re-run forward computes with copies of X's buffers as its forward found them, and mutates only those:
  BatchNorm's running statistics and ``num_batches_tracked`` are updated once per step. (All buffers are copied, at
  every recorded call: kernels such as batch norm's update their statistics without bumping the tensor's version, so
  which ones a forward mutates cannot be told cheaply. Cheap operators hold a few values per channel; the search
  offers none with more, see :func:`recompute_unsuitable`.) It restores the RNG state it found, and does no step
  bookkeeping: weight-cast recording and saved-tensor hooks find nothing to save under ``no_grad``, the consumer
  tracer of a calibrating step is silenced (the recomputer's own reads of tensors in the step are too), and the
  wrapped hooks make no recipe.

Where the recipe would be wrong it is refused loudly: an input modified in place after X's forward raises
:class:`~lightning_comp.errors.UsageError` when backward unpacks the recipe (as a weight modified in place between
forward and backward does, :mod:`lightning_comp.execution.weight_casts`), and so does a recomputation that gives an
output of another shape, layout or dtype; an operator whose output is not a tensor or a tuple/list of tensors, or
that modifies its own input in place, raises :class:`~lightning_comp.errors.PlanError` at its first training step.
X's hooks inside saved-tensor hooks that were entered within the step (``torch.utils.checkpoint``'s, ``save_on_cpu``
entered in ``training_step``) leave X to those hooks, and say so once.

Recipes are made only in training steps whose autograd records; validation, ``no_grad`` and inference run X as
usual. :func:`recompute_unsuitable` tells the search which operators not to offer ``recompute`` at all.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_comp.adapters.torch_internals import (
    reparametrized,
    storage_key,
    tensor_base,
    tensor_version,
    top_saved_tensors_hooks,
)
from lightning_comp.common.nested import map_tensors, tensors
from lightning_comp.errors import PlanError, UsageError
from lightning_comp.execution.saved_hooks import OuterHooks, hooks_installable, take_back
from lightning_comp.execution.saved_tensors import is_compressor_pack
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.kinds import OperatorKind, classify, is_recurrent
from lightning_comp.operators.owned_work import runs_planned_work

__all__ = ["MAX_BUFFER_BYTES", "Recomputer", "recompute_unsuitable"]

_RAW, _FINAL = 0, 1  # an output as the forward returned it / as the post-hook handed it on (cast back to FP32)
_View = tuple[torch.Size, tuple[int, ...], int]  # a view of an output: size, stride, storage offset
_CAST = "ToCopyBackward0"  # the autograd node of a cast (``.to(dtype)``, autocast's and the hooks' input casts)
# Nodes of views that only reshape (row-major order kept): a cast of such a view of an output is the cast of the
# output reshaped, whatever the view chain's intermediate shapes were (Flatten between a norm and a projection).
_RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
_MAX_RESHAPES = 4  # reshape nodes followed from a cast towards an output
_KEEP_AS_COMPUTED = "Keep its saved precision as computed ('fp32') in the plan"
_keep_as_computed = _KEEP_AS_COMPUTED[0].lower() + _KEEP_AS_COMPUTED[1:]
#: Operators with more bytes of buffers than this are not offered ``recompute`` (each recorded call copies them).
MAX_BUFFER_BYTES = 1 << 20


def recompute_unsuitable(module: nn.Module) -> str | None:
    """Why the search should not offer ``saved="recompute"`` for ``module`` (``None``: it may).

    Only cheap operators are worth recomputing (norms, activations, dropout, pooling, look-ups): recomputing a
    matmul, convolution, recurrent layer or attention costs as much as its forward, and a region around it is better
    checkpointed as a whole. Operators that only reshape free nothing; operators working in place overwrite the
    input the recipe needs; an operator's buffers are copied at every recorded call, so one holding more than
    :data:`MAX_BUFFER_BYTES` of them is not worth it. Whether an operator returns a tensor (or a tuple or list of
    them) shows only when it runs: one that does not is refused at its first training step.

    Args:
        module: the operator.
    """
    kind = classify(module)
    if kind is OperatorKind.SHAPE:
        return "it only reshapes: its output shares its input's memory, so recomputing it frees nothing"
    if getattr(module, "inplace", False) is True:
        return "it computes in place: it overwrites the input its output would be recomputed from"
    if is_recurrent(module):
        return "a recurrent layer costs as much to recompute as its forward, and returns nested tuples"
    if kind in (OperatorKind.COMPUTE, OperatorKind.FUNCTIONAL) or runs_planned_work(module):
        return ("it does matmul/convolution/attention work: recomputing it costs as much as its forward (checkpoint a"
                " region around it instead)")
    if kind is OperatorKind.OTHER:
        return "a user-defined operator with parameters: what recomputing it costs is unknown"
    buffer_bytes = sum(b.nbytes for b in module.buffers())
    if buffer_bytes > MAX_BUFFER_BYTES:
        return f"it holds {buffer_bytes} bytes of buffers, which every recorded call would copy"
    return None


# ------------------------------------------------------------------------------------------------------ protocols
class _Operator(Protocol):
    """What the recomputer reads of a hooked operator."""

    @property
    def name(self) -> str: ...

    @property
    def module(self) -> nn.Module: ...


class _State(Protocol):
    """What the recomputer reads and sets of the step's state (:class:`~lightning_comp.execution.hooks.StepState`)."""

    tracer: Any
    chained: frozenset[str]
    regions: int
    device: torch.device | None


Hook = Callable[[nn.Module, Any, Any], Any]


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

    def __init__(self, state: _State) -> None:
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


def _describe(op: _Operator) -> str:
    return f"{op.name or '<root>'!r} ({type(op.module).__name__})"


# ---------------------------------------------------------------------------------------------------- one call
@dataclass(frozen=True)
class _Meta:
    """What an output looked like, to check its recomputation against and to find tensors saved of it."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    version: int

    @staticmethod
    def of(tensor: torch.Tensor) -> _Meta:
        return _Meta(tensor.size(), tuple(tensor.stride()), int(tensor.storage_offset()), tensor.dtype,
                     tensor_version(tensor))

    def matches(self, tensor: torch.Tensor) -> bool:
        return (tensor.size() == self.size and tuple(tensor.stride()) == self.stride
                and int(tensor.storage_offset()) == self.offset and tensor.dtype == self.dtype)


@dataclass(frozen=True)
class _Held:
    """An input kept by reference (it shares storage with whoever else keeps it), and its version then."""

    tensor: torch.Tensor
    version: int


@dataclass(frozen=True)
class _Derived:
    """An input that is (a view of) another recipe's output: recomputed from that recipe instead of kept."""

    recipe: _Recipe
    stage: int
    index: int
    view: _View | None
    cast: _Cast | None = None

    def value(self) -> torch.Tensor:
        return _form(self.recipe.value(self.stage, self.index), self.cast, self.view)


@dataclass(frozen=True)
class _Cast:
    """A cast of an output (or of a reshape of it) made outside its operator: by a consumer's autocast region or
    input cast, or by ``.to(dtype)`` in the model's code. Its recomputation casts the recomputed output the same way
    (the same conversion kernel, so bit-identical), into a tensor of the cast's layout."""

    dtype: torch.dtype
    device: torch.device
    size: torch.Size
    stride: tuple[int, ...]
    reshaped: bool  # the cast is of a reshape of the output (to ``size``)

    def apply(self, out: torch.Tensor) -> torch.Tensor:
        source = out.reshape(self.size) if self.reshaped else out
        with torch.no_grad():
            return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device).copy_(source)


def _form(out: torch.Tensor, cast: _Cast | None, view: _View | None) -> torch.Tensor:
    """What was saved of (recomputed) output ``out``: it, its cast, or a view of either."""
    if cast is not None:
        out = cast.apply(out)
    return out if view is None else out.as_strided(*view)


@dataclass(frozen=True)
class _Rng:
    """The RNG states a forward started from: the CPU's, and those of the accelerators its inputs live on."""

    cpu: torch.Tensor
    device_type: str
    devices: list[int]
    states: list[torch.Tensor]

    @staticmethod
    def capture(inputs: list[torch.Tensor]) -> _Rng:
        device_type = next((t.device.type for t in inputs if t.device.type not in ("cpu", "meta")), "cuda")
        devices, states = get_device_states(*inputs)  # (none for CPU tensors: no accelerator is touched)
        return _Rng(torch.get_rng_state(), device_type, devices, states)

    @contextmanager
    def restored(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu)
            if self.devices:
                set_device_states(self.devices, self.states, device_type=self.device_type)
            yield


@dataclass
class _Frame:
    """One call of a recompute operator in a step, from its pre-hook to its post-hook."""

    op: _Operator
    autocast: list[tuple[str, bool, torch.dtype, bool]]
    regions: int
    rng: _Rng | None = None  # (set once the pre-hook has cast the inputs)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    args: Any = ()
    kwargs: Any = None
    inputs: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    input_ids: frozenset[int] = frozenset()
    pending: list[_Pending] = field(default_factory=list)


class _Recipe:
    """How to recompute the outputs of one call of a recompute operator (see the module docstring)."""

    __slots__ = ("recomputer", "op", "args", "kwargs", "chained", "regions", "autocast", "rng", "buffers", "metas",
                 "users", "cache", "captured")

    def __init__(self, recomputer: Recomputer, frame: _Frame, chained: frozenset[str],
                 metas: tuple[list[_Meta | None], list[_Meta | None]], args: Any, kwargs: Any) -> None:
        self.recomputer = recomputer
        self.op = frame.op
        self.args, self.kwargs = args, kwargs
        self.chained = chained
        self.regions = frame.regions
        self.autocast = frame.autocast
        self.rng = frame.rng
        self.buffers = frame.buffers
        self.metas = metas
        self.users = 0  # references saved for backward alive now (the cache lives as long as one is)
        self.cache: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None = None
        self.captured: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None = None

    def version(self, stage: int, index: int) -> int:
        meta = self.metas[stage][index]
        return -1 if meta is None else meta.version

    def dtype(self, stage: int, index: int) -> torch.dtype | None:
        meta = self.metas[stage][index]
        return None if meta is None else meta.dtype

    def value(self, stage: int, index: int) -> torch.Tensor:
        """The output ``index`` at ``stage``, recomputed (once while references to it are alive)."""
        outs = self.cache
        if outs is None:
            outs = self._recompute()
            if self.users > 0:
                self.cache = outs
        out = outs[stage][index]
        assert out is not None
        return out

    def release(self) -> None:
        """A reference saved for backward died: drop the cached outputs once none is left."""
        self.users -= 1
        if self.users <= 0:
            self.cache = None

    def _inputs(self) -> tuple[Any, Any]:
        def get(item: _Held | _Derived) -> torch.Tensor:
            if isinstance(item, _Derived):
                return item.value()
            now = tensor_version(item.tensor)
            if now != item.version:
                raise UsageError(
                    f"Operator {_describe(self.op)} saves 'recompute', but an input it keeps to recompute its output"
                    f" in backward was modified in place after its forward (version {item.version} -> {now}), so"
                    f" its output can no longer be recomputed. {_KEEP_AS_COMPUTED}, or do not modify that tensor in"
                    " place before backward."
                )
            return item.tensor

        return (apply_to_collection(self.args, (_Held, _Derived), get),
                apply_to_collection(self.kwargs, (_Held, _Derived), get))

    def _recompute(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        args, kwargs = self._inputs()
        module = self.op.module
        with ExitStack() as stack:
            if self.rng is not None:
                stack.enter_context(self.rng.restored())
            for device_type, enabled, dtype, cache in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
            stack.enter_context(torch.no_grad())
            if self.buffers:  # copies as the forward found them: the step's own update happened once, in the step
                stack.enter_context(reparametrized(module, {n: b.clone() for n, b in self.buffers.items()}))
            stack.enter_context(self.recomputer._recomputing(self))
            module(*args, **kwargs)
        captured, self.captured = self.captured, None
        if captured is None:
            raise UsageError(
                f"Operator {_describe(self.op)} saves 'recompute', but its plan's hooks were taken off between its"
                " forward and backward, so its output cannot be recomputed in the precision it was computed in."
                f" Run backward before removing or changing the plan, or {_keep_as_computed}."
            )
        for stage in (_RAW, _FINAL):
            for meta, out in zip(self.metas[stage], captured[stage]):
                if meta is not None and (out is None or not meta.matches(out)):
                    raise UsageError(
                        f"Operator {_describe(self.op)} saves 'recompute', but recomputing it in backward gave an"
                        f" output of another shape, layout or dtype than its forward ({meta.dtype}"
                        f" {tuple(meta.size)} expected). Its forward depends on more than its inputs, RNG and"
                        f" buffers: {_keep_as_computed}."
                    )
        return captured


class _Saved:
    """What autograd keeps for a saved tensor that is (a view of) a recipe's output."""

    __slots__ = ("recipe", "stage", "index", "view", "cast")

    def __init__(self, recipe: _Recipe, stage: int, index: int, view: _View | None, cast: _Cast | None = None) -> None:
        self.recipe, self.stage, self.index, self.view, self.cast = recipe, stage, index, view, cast
        recipe.users += 1

    def __del__(self) -> None:
        self.recipe.release()

    def unpack(self) -> torch.Tensor:
        return _form(self.recipe.value(self.stage, self.index), self.cast, self.view)


class _Pending:
    """A tensor saved inside a recompute operator's forward, before its output exists: its post-hook makes it a
    reference to the recipe (if it is one of the outputs) or hands it on to the outer hooks."""

    __slots__ = ("tensor", "version", "outer", "saved")

    def __init__(self, tensor: torch.Tensor, outer: OuterHooks) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.version = tensor_version(tensor)
        self.outer = outer
        self.saved: Any = None

    def resolve(self, saved: _Saved | None) -> None:
        """Keep ``saved`` instead of the tensor (``None``: hand the tensor on to the outer hooks)."""
        tensor, self.tensor = self.tensor, None
        assert tensor is not None
        self.saved = saved if saved is not None else self.outer.hand_on(tensor)

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None:  # never resolved: the forward raised
            return self.tensor
        if isinstance(self.saved, _Saved):
            return self.saved.unpack()
        return take_back(self.saved)  # type: ignore[no-any-return]


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, (_Saved, _Pending)):
        return saved.unpack()
    return take_back(saved)  # type: ignore[no-any-return]


def _outputs(op: _Operator, output: Any) -> list[torch.Tensor | None]:
    """The tensors of a recompute operator's output, by position.

    Raises:
        PlanError: if the output is not a tensor or a tuple/list of tensors (``None`` allowed).
    """
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in output):
        return list(output)
    raise PlanError(
        f"Operator {_describe(op)} saves 'recompute', but its forward returns {type(output).__name__}: only an"
        f" operator returning a tensor, or a tuple or list of tensors, can be recomputed. {_KEEP_AS_COMPUTED}."
    )


# ------------------------------------------------------------------------------------------------- the engine
class Recomputer:
    """Stores recipes instead of recompute operators' outputs in training steps (see the module docstring).

    Args:
        state: the step's state, read when a forward is recorded and set while it is recomputed.
    """

    def __init__(self, state: _State) -> None:
        self._state = state
        self._recording = False
        self._outer: OuterHooks | None = None  # the hooks in force around the step being recorded
        self._outputs: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # output -> (recipe, index)
        self._view_bases: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # base of a view output -> [...]
        self._nodes: dict[int, list[_Node]] = {}  # an output's autograd node's sequence number -> [...]
        self._frames: list[_Frame | None] = []  # one per hooked call in flight (None: not recorded)
        self._open: list[_Frame] = []  # the recorded ones
        self._target: _Recipe | None = None  # the recipe being recomputed now
        self._pack_hook: Callable[[torch.Tensor], Any] | None = None
        self._warned: set[str] = set()
        self._unseen = _Unseen(state)

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the plugin: recipes and weak tables belong to this process
        return {**self.__dict__, "_outputs": None, "_view_bases": None, "_nodes": {}, "_frames": [], "_open": [],
                "_unseen": None,
                "_target": None, "_pack_hook": None, "_recording": False, "_outer": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._outputs = WeakTensorKeyDictionary()
        self._view_bases = WeakTensorKeyDictionary()
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
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                yield
        finally:
            self._recording = False
            self._pack_hook = self._outer = None
            self._outputs = WeakTensorKeyDictionary()
            self._view_bases = WeakTensorKeyDictionary()
            self._nodes = {}
            self._frames.clear()
            self._open.clear()

    # ------------------------------------------------------------------------------------------ saved tensors
    def claims(self, tensor: torch.Tensor) -> bool:
        """Whether the recompute hooks will store ``tensor`` as a recipe (or may: it is saved inside a recompute
        operator's forward before its output exists); a compressing operator then hands it on uncompressed."""
        if not self._recording:
            return False
        with self._unseen:
            if self._lookup(tensor) is not None:
                return True
        return bool(self._open) and not tensor.is_leaf and id(tensor) not in self._open[-1].input_ids

    def _pack(self, tensor: torch.Tensor) -> Any:
        outer = self._outer
        assert outer is not None
        with self._unseen:
            found = self._lookup(tensor)
        if found is not None:
            return _Saved(*found)
        if self._open and not tensor.is_leaf:
            frame = self._open[-1]
            if id(tensor) not in frame.input_ids:
                pending = _Pending(tensor, outer)
                frame.pending.append(pending)
                return pending
        return outer.hand_on(tensor)

    def _lookup(self, tensor: torch.Tensor) -> tuple[_Recipe, int, int, _View | None, _Cast | None] | None:
        """The recipe output ``tensor`` is (or is a view of, or a cast of, or a view of a cast of), unchanged
        since; ``None`` if none."""
        entry = self._outputs.get(tensor)
        if entry is not None:
            recipe, index = entry
            if tensor_version(tensor) == recipe.version(_FINAL, index):
                return recipe, _FINAL, index, None, None
            return None
        base = tensor_base(tensor)
        if base is not tensor:
            entry = self._outputs.get(base)
            candidates = [entry] if entry is not None else self._view_bases.get(base, [])
            version = tensor_version(tensor)
            for recipe, index in candidates:
                if recipe.dtype(_FINAL, index) == tensor.dtype and recipe.version(_FINAL, index) == version:
                    return recipe, _FINAL, index, _view_of(tensor), None
            if candidates:
                return None
        return self._cast_lookup(tensor, base) if self._nodes else None

    def _cast_lookup(self, tensor: torch.Tensor, cast: torch.Tensor,
                     ) -> tuple[_Recipe, int, int, _View | None, _Cast] | None:
        """The recipe output ``cast`` (``tensor``'s base) is a cast of, possibly through reshapes, made while both
        were unchanged (neither modified in place since); ``None`` if none."""
        fn = cast.grad_fn
        if fn is None or fn.name() != _CAST or tensor_version(cast) != 0 or cast.layout is not torch.strided \
                or int(cast.storage_offset()) != 0:
            return None
        edges = fn.next_functions
        reshaped = False
        for _ in range(_MAX_RESHAPES + 1):
            node, output_nr = edges[0] if len(edges) == 1 else (None, 0)
            if node is None:
                return None
            for entry in self._nodes.get(node._sequence_nr(), ()):
                out = entry.output()
                if out is None or entry.output_nr != output_nr or out.grad_fn is not node \
                        or tensor_version(out) != entry.recipe.version(_FINAL, entry.index) \
                        or out.device != cast.device \
                        or (out.numel() != cast.numel() if reshaped else out.size() != cast.size()):
                    continue
                made = _Cast(cast.dtype, cast.device, cast.size(), tuple(cast.stride()), reshaped)
                return entry.recipe, _FINAL, entry.index, None if tensor is cast else _view_of(tensor), made
            if node.name() not in _RESHAPES:
                return None
            edges, reshaped = node.next_functions, True
        return None

    def _derived(self, tensor: torch.Tensor) -> _Held | _Derived:
        found = self._lookup(tensor)
        return _Held(tensor, tensor_version(tensor)) if found is None else _Derived(*found)

    # -------------------------------------------------------------------------------------------------- hooks
    def wrap(self, op: _Operator, pre_hook: Hook, post_hook: Hook) -> tuple[Hook, Hook]:
        """The pre-hook (with kwargs) and post-hook of recompute operator ``op``: ``pre_hook``/``post_hook`` with the
        recipe bookkeeping around them."""
        state = self._state

        def pre(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if not self._recording or self._target is not None or not torch.is_grad_enabled():
                self._frames.append(None)
                return pre_hook(module, args, kwargs)
            if not self._innermost():
                self._say_left_to_outer_hooks(op)
                self._frames.append(None)
                return pre_hook(module, args, kwargs)
            frame = _Frame(op, self._autocast_state(), state.regions)
            self._frames.append(frame)  # (first: the post-hook runs even if a pre-hook raises)
            with self._unseen:
                frame.buffers = {n: b.clone() for n, b in module.named_buffers()}  # (kernels update some unversioned)
            result = pre_hook(module, args, kwargs)
            with self._unseen:
                frame.args, frame.kwargs = result if result is not None else (args, kwargs)
                frame.inputs = tensors((frame.args, frame.kwargs))
                frame.versions = [tensor_version(t) for t in frame.inputs]
                frame.input_ids = frozenset(id(t) for t in frame.inputs)
                frame.rng = _Rng.capture(frame.inputs)
            self._open.append(frame)
            return result

        def post(module: nn.Module, args: Any, output: Any) -> Any:
            frame = self._frames.pop() if self._frames else None
            if frame is not None and self._open and self._open[-1] is frame:
                self._open.pop()
            raw = output
            final = post_hook(module, args, output)
            target = self._target
            if target is not None and target.op.module is module and raw is not None:
                target.captured = (_outputs(op, raw), _outputs(op, final))
            if frame is not None and (raw is not None or sys.exc_info()[1] is None):  # (None: the forward raised)
                with self._unseen:
                    self._finish(frame, raw, final)
            return final

        return pre, post

    def _innermost(self) -> bool:
        """Whether the saved-tensor hooks in force are this step's recompute hooks, or a compressing operator's
        (which hands on to them): not hooks entered within the step by someone else."""
        top = top_saved_tensors_hooks()
        return top is not None and (top[0] is self._pack_hook or is_compressor_pack(top[0]))

    def _say_left_to_outer_hooks(self, op: _Operator) -> None:
        if op.name in self._warned:
            return
        self._warned.add(op.name)
        rank_zero_warn(
            f"Operator {_describe(op)} saves 'recompute', but it ran inside saved-tensor hooks entered within the"
            " training step (torch.utils.checkpoint's, save_on_cpu or a profiler's entered in training_step): those"
            " hooks decide how its output is kept there, and it is not recomputed by lightning-comp. Enter them"
            " around the whole step, or keep the operator's saved precision as computed ('fp32').",
            stacklevel=2,
        )

    def _autocast_state(self) -> list[tuple[str, bool, torch.dtype, bool]]:
        device = self._state.device
        types = ["cpu"] if device is None or device.type == "cpu" else ["cpu", device.type]
        cache = torch.is_autocast_cache_enabled()
        return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t), cache) for t in types]

    def _finish(self, frame: _Frame, raw: Any, final: Any) -> None:
        """At the post-hook of a recorded call: make its recipe, resolve its placeholders, register its outputs."""
        op = frame.op
        raw_outs, final_outs = _outputs(op, raw), _outputs(op, final)
        for tensor, version in zip(frame.inputs, frame.versions):
            if tensor_version(tensor) != version:
                raise PlanError(
                    f"Operator {_describe(op)} saves 'recompute', but its forward modifies its input in place, so"
                    f" the input its output would be recomputed from is gone. {_KEEP_AS_COMPUTED}, or make it work"
                    " out of place (inplace=False)."
                )
        inputs = {storage_key(t) for t in frame.inputs}
        metas: tuple[list[_Meta | None], list[_Meta | None]] = (
            [None if t is None or storage_key(t) in inputs else _Meta.of(t) for t in raw_outs],
            [None if t is None or storage_key(t) in inputs else _Meta.of(t) for t in final_outs],
        )  # an output sharing an input's memory is kept with that input anyway
        held = map_tensors((frame.args, frame.kwargs), self._derived)
        recipe = _Recipe(self, frame, self._state.chained, metas, held[0], held[1])
        stages = ((_RAW, raw_outs), (_FINAL, final_outs))
        for pending in frame.pending:
            found = _match(pending, stages, metas)
            if found is not None:
                pending.resolve(_Saved(recipe, *found))
            elif self._open:  # it may be an output of the enclosing recompute operator
                self._open[-1].pending.append(pending)
            else:
                pending.resolve(None)
        frame.pending.clear()
        for index, (out, meta) in enumerate(zip(final_outs, metas[_FINAL])):
            if out is None or meta is None:
                continue
            self._outputs[out] = (recipe, index)
            fn = out.grad_fn
            if fn is not None:  # (casts of it are found from their autograd node)
                self._nodes.setdefault(fn._sequence_nr(), []).append(
                    _Node(out.output_nr, weakref.ref(out), recipe, index))
            base = tensor_base(out)
            if base is not out:
                entries = self._view_bases.get(base)
                if entries is None:
                    self._view_bases[base] = entries = []
                entries.append((recipe, index))

    @contextmanager
    def _recomputing(self, recipe: _Recipe) -> Iterator[None]:
        """While ``recipe``'s forward is recomputed: the step's state as it was in that forward, no bookkeeping."""
        state = self._state
        saved = self._target, state.chained, state.regions
        with _Unseen(state):
            tracer, state.tracer = state.tracer, None
            self._target, state.chained, state.regions = recipe, recipe.chained, recipe.regions
            try:
                yield
            finally:
                self._target, state.chained, state.regions = saved
                state.tracer = tracer


def _view_of(tensor: torch.Tensor) -> _View:
    return tensor.size(), tuple(tensor.stride()), int(tensor.storage_offset())


@dataclass(frozen=True)
class _Node:
    """An output of a recipe, as found from the autograd node of a cast of it (the output is weakly held: it may
    die before a cast of it is saved, and is then no longer recognised)."""

    output_nr: int
    output: weakref.ref[torch.Tensor]
    recipe: _Recipe
    index: int


def _match(pending: _Pending, stages: tuple[tuple[int, list[torch.Tensor | None]], ...],
           metas: tuple[list[_Meta | None], list[_Meta | None]],
           ) -> tuple[int, int, _View | None] | None:
    """Which output (stage, index, view) a tensor saved inside the forward is, unchanged since; ``None``: none."""
    tensor = pending.tensor
    assert tensor is not None
    for stage, outs in stages:
        for index, out in enumerate(outs):
            meta = metas[stage][index]
            if out is tensor and meta is not None and meta.version == pending.version:
                return stage, index, None
    base = tensor_base(tensor)
    for stage, outs in stages:
        for index, out in enumerate(outs):
            meta = metas[stage][index]
            if out is None or meta is None or meta.dtype != tensor.dtype or meta.version != pending.version:
                continue
            if base is out or (base is not tensor and tensor_base(out) is base):
                return stage, index, (tensor.size(), tuple(tensor.stride()), int(tensor.storage_offset()))
    return None

