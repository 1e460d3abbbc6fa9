"""The work a module does itself, found by tracing one step: :class:`WorkRecorder` and what it records.

Most model code computes between its submodules: litgpt's ``CausalSelfAttention`` calls
``scaled_dot_product_attention`` between its ``qkv`` and ``proj`` projections, x-transformers' ``Attend`` computes
attention with ``einsum``, a tied language-model head multiplies by the embedding's weight. No hook of a child module
ever sees those calls. :class:`WorkRecorder` runs one step under a dispatch mode that sees every aten op (after
autograd and autocast), with the modules whose forward runs now on a stack (global forward hooks), and gives each
compute-heavy op of the forward to the innermost module running it: the *owner* of that work.

A module with child modules that owns matmul, convolution, attention or recurrent work directly is an operator of its
own (:class:`~lightning_comp.operators.kinds.OperatorKind` ``FUNCTIONAL``, see
:mod:`lightning_comp.operators.discovery`), planned for that work only: its children stay operators of their own.
Which modules own work is kept per module object (weakly), so every name a model is reached by (compiled or not,
the LightningModule or a submodule) sees the same operators.

The floating-point operations of matmuls, convolutions and attention are counted (forward only; backward is about
twice the forward for each), so a plan can be told what share of the step's work it leaves outside its operators.
Normalisations are recorded by count but not counted as floating-point work (a few operations per element).
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_comp.adapters.torch_internals import TORCH_DISPATCH_MODE, WRAPPER_ATTRIBUTES, in_backward

__all__ = ["OUTSIDE", "OwnedWork", "StepWork", "WorkFamily", "WorkRecorder", "owns_planned_work", "runs_planned_work",
           "was_traced", "work_family"]

#: The owner of work done outside every module's forward (``training_step``'s own code, the loss).
OUTSIDE = "<outside every module>"


class WorkFamily(str, Enum):
    """The kinds of compute-heavy aten ops a trace gives an owner."""

    MATMUL = "matmul"  # mm, addmm, bmm (einsum, matmul, linear decompose into these), baddbmm, ...
    CONVOLUTION = "convolution"
    ATTENTION = "attention"  # the fused scaled-dot-product attention kernels
    RECURRENT = "recurrent"  # fused LSTM/GRU layers and cells
    NORM = "norm"  # layer/group/batch/RMS normalisation kernels

    @property
    def planned(self) -> bool:
        """Whether owning this work makes a container module an operator (an autocast region lowers it)."""
        return self is not WorkFamily.NORM


_FAMILIES: dict[str, WorkFamily] = {
    **dict.fromkeys(("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_scaled_mm"),
                    WorkFamily.MATMUL),
    **dict.fromkeys(("convolution", "_convolution", "convolution_overrideable", "cudnn_convolution",
                     "cudnn_convolution_transpose", "mkldnn_convolution", "_slow_conv2d_forward",
                     "slow_conv3d_forward", "slow_conv_transpose2d", "slow_conv_transpose3d", "thnn_conv2d",
                     "_conv_depthwise2d", "conv_depthwise3d"), WorkFamily.CONVOLUTION),
    **dict.fromkeys(("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                     "_efficient_attention_forward", "_native_multi_head_attention"), WorkFamily.ATTENTION),
    **dict.fromkeys(("mkldnn_rnn_layer", "_cudnn_rnn", "miopen_rnn", "_thnn_fused_lstm_cell",
                     "_thnn_fused_gru_cell"), WorkFamily.RECURRENT),
    **dict.fromkeys(("native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
                     "_native_batch_norm_legit_no_training", "_fused_rms_norm", "cudnn_batch_norm",
                     "miopen_batch_norm", "_batch_norm_with_update"), WorkFamily.NORM),
}


def work_family(op_name: str) -> WorkFamily | None:
    """The family of the aten op named ``op_name`` (its overload packet's name, e.g. ``"bmm"``), or ``None`` for an
    op that is not compute-heavy."""
    return _FAMILIES.get(op_name)


def _numel(shape: Any) -> int:
    return math.prod(int(s) for s in shape)


def _flops(op_name: str, family: WorkFamily, args: tuple[Any, ...], out: Any) -> int:
    """Floating-point operations of one forward op (multiply-adds count 2), or 0 where they are not counted."""
    shapes = [a.shape for a in args if isinstance(a, torch.Tensor)]
    if family is WorkFamily.MATMUL and len(shapes) >= 2:
        a, b = shapes[-2], shapes[-1]  # (bias,) mat1, mat2 / batch1, batch2 / matrix, vector
        if op_name in ("dot", "vdot"):
            return 2 * _numel(a)
        if len(b) == 1:  # mv, addmv
            return 2 * _numel(a)
        return 2 * _numel(a) * int(b[-1])
    if family is WorkFamily.CONVOLUTION and len(shapes) >= 2 and isinstance(out, torch.Tensor):
        weight = shapes[1]
        transposed = bool(args[6]) if len(args) > 6 and isinstance(args[6], bool) else False
        return 2 * _numel(shapes[0] if transposed else out.shape) * _numel(weight[1:])
    if family is WorkFamily.ATTENTION and len(shapes) >= 3:
        q, k, v = shapes[:3]
        if len(q) < 2 or len(k) < 2 or len(v) < 1:
            return 0
        if op_name == "_native_multi_head_attention":  # [B, L, E] projections included: count the product only
            return 2 * _numel(q[:-1]) * int(k[-2]) * 2 * int(q[-1])
        batch = _numel(q[:-2])
        if op_name in ("_flash_attention_forward", "_efficient_attention_forward"):  # [B, L, H, E] layouts
            batch = int(q[0]) * int(q[2])
            return 2 * batch * int(q[1]) * int(k[1]) * (int(q[-1]) + int(v[-1]))
        return 2 * batch * int(q[-2]) * int(k[-2]) * (int(q[-1]) + int(v[-1]))
    return 0


@dataclass(frozen=True)
class OwnedWork:
    """The compute-heavy forward ops one module ran itself (inside none of its children) in one step.

    Attributes:
        ops: ``(aten op, calls)``, sorted by op name.
        flops: their floating-point operations (matmul, convolution and attention ops; 0 for the others).
    """

    ops: tuple[tuple[str, int], ...] = ()
    flops: int = 0

    @property
    def families(self) -> frozenset[WorkFamily]:
        """The families of its ops."""
        return frozenset(f for f in (work_family(op) for op, _ in self.ops) if f is not None)

    @property
    def planned(self) -> bool:
        """Whether it holds work an autocast region lowers (matmul, convolution, attention, recurrent)."""
        return any(f.planned for f in self.families)


@dataclass(frozen=True)
class StepWork:
    """The compute-heavy work of one traced step, by owning module.

    Attributes:
        by_module: operator-style module name (as :func:`~lightning_comp.operators.discovery.operator_name` gives
            it) -> the work it did itself; :data:`OUTSIDE` for work outside every module's forward.
    """

    by_module: Mapping[str, OwnedWork] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_module", MappingProxyType(dict(self.by_module)))

    @property
    def total_flops(self) -> int:
        """Every counted floating-point operation of the step's forward."""
        return sum(work.flops for work in self.by_module.values())


# Module objects found to own planned work, and every module object a trace has seen: a module of a model that was
# traced and owns nothing is known not to be an operator of its own (weakly: the model's lifetime decides).
_OWNERS: weakref.WeakKeyDictionary[nn.Module, OwnedWork] = weakref.WeakKeyDictionary()
_TRACED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_RUNS_PLANNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # every module, leaves too, a trace saw run such work


def runs_planned_work(module: nn.Module) -> bool:
    """Whether a trace found ``module`` (a leaf or a container) running matmul, convolution, attention or recurrent
    work in its own forward, e.g. a parameter-free leaf wrapping ``scaled_dot_product_attention``."""
    return module in _RUNS_PLANNED


def owns_planned_work(module: nn.Module) -> bool:
    """Whether a trace found ``module`` running matmul, convolution, attention or recurrent work itself."""
    return module in _OWNERS


def was_traced(module: nn.Module) -> bool:
    """Whether ``module`` belongs to a model a :class:`WorkRecorder` has traced."""
    return module in _TRACED


class WorkRecorder:
    """Within a ``with`` block: record which module of ``model`` owns each compute-heavy forward op.

    On leaving the block, the modules found owning planned work are recorded (so
    :func:`~lightning_comp.operators.discovery.iter_operators` lists them) and :attr:`work` holds the step's work.
    Ops run in backward (the autograd engine, activation checkpointing's recomputation) are not recorded: their
    owner is the forward's.

    Args:
        model: the model whose modules own work; calls of other modules (a DDP wrapper, a loss module of another
            tree) count as outside.
    """

    def __init__(self, model: nn.Module) -> None:
        self._names: dict[int, tuple[str, nn.Module]] = {}
        for qualified, module in model.named_modules():
            name = ".".join(p for p in qualified.split(".") if p not in WRAPPER_ATTRIBUTES)
            self._names.setdefault(id(module), (name, module))
        self._stack: list[int] = []
        self._ops: dict[int, Counter[str]] = {}
        self._flops: Counter[int] = Counter()
        self._exits: list[Any] = []
        self.work = StepWork()

    def __enter__(self) -> WorkRecorder:
        names, stack = self._names, self._stack

        def push(module: nn.Module, args: Any) -> None:
            if id(module) in names:
                stack.append(id(module))

        def pop(module: nn.Module, args: Any, output: Any) -> None:
            if stack and stack[-1] == id(module):
                stack.pop()

        self._exits = [register_module_forward_pre_hook(push), register_module_forward_hook(pop, always_call=True)]
        mode = _OwnershipMode(self)
        mode.__enter__()
        self._exits.append(mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        mode = self._exits.pop()
        mode.__exit__(*exc)
        for handle in self._exits:
            handle.remove()
        self._exits = []
        self._finish()

    def record(self, op_name: str, family: WorkFamily, args: tuple[Any, ...], out: Any) -> None:
        """Give one forward op to the module running it now (the dispatch mode's callback)."""
        owner = self._stack[-1] if self._stack else 0
        self._ops.setdefault(owner, Counter())[op_name] += 1
        self._flops[owner] += _flops(op_name, family, args, out)

    def _finish(self) -> None:
        by_module: dict[str, OwnedWork] = {}
        for owner, ops in self._ops.items():
            work = OwnedWork(tuple(sorted(ops.items())), self._flops[owner])
            if owner == 0:
                by_module[OUTSIDE] = work
                continue
            name, module = self._names[owner]
            by_module[name] = work
            if work.planned:
                _RUNS_PLANNED.add(module)
            if work.planned and next(module.children(), None) is not None:
                _OWNERS[module] = work
        for _, module in self._names.values():
            _TRACED.add(module)
        self.work = StepWork(by_module)


class _OwnershipMode(TORCH_DISPATCH_MODE):  # type: ignore[misc]
    """Hands every compute-heavy forward op to its recorder."""

    def __init__(self, recorder: WorkRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else getattr(func, "__name__", "")
        family = _FAMILIES.get(name)
        if family is not None and not in_backward():
            self.recorder.record(name, family, args, out)
        return out

