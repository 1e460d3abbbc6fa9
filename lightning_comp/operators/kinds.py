"""What an operator does, which decides how a low precision can apply to it: its :class:`OperatorKind`.

An *operator* is a module that does the work itself: every leaf module; modules that must be treated whole because
their forward is one fused kernel, or reads its children's parameters without calling them (``nn.LSTM``/``nn.GRU``/
``nn.RNN``, ``nn.MultiheadAttention`` and anything registered with :func:`register_atomic`); and modules with children
that a trace found computing matmuls, convolutions, attention or recurrent cells themselves, between their children
(``FUNCTIONAL``: litgpt's ``CausalSelfAttention``, x-transformers' ``Attend``, Hugging Face's ``GPT2Attention``; see
:mod:`lightning_comp.operators.owned_work`). Their children stay operators of their own.

Hugging Face's ``Conv1D`` is known by qualified class name (nothing is imported): it computes as an ``nn.Linear`` and
is lowered as one.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeGuard

import torch
from torch import nn

from lightning_comp.adapters.torch_internals import BATCH_NORM_BASE, CONV_BASE, NORM_BASE
from lightning_comp.errors import ConfigError
from lightning_comp.operators.owned_work import owns_planned_work, runs_planned_work

__all__ = ["COMPUTE_CLASS_KINDS", "JUDGED_KINDS", "OperatorKind", "autocast_like", "classify", "does_no_arithmetic",
           "is_atomic", "is_functional", "is_recurrent", "judged_as_compute", "linear_sizes", "normalises_input_only",
           "register_atomic", "weight_reading"]


class OperatorKind(str, Enum):
    """What an operator does, which decides how low precision can apply to it."""

    COMPUTE = "compute"  # matmul/conv/recurrent/attention: the ops low precision speeds up
    NORM = "norm"  # BatchNorm/LayerNorm/GroupNorm/...: low-precision input, FP32 statistics
    ELEMENTWISE = "elementwise"  # parameter-free activations, dropout, pooling, softmax, padding, ...
    EMBEDDING = "embedding"  # table look-ups
    SHAPE = "shape"  # Flatten/Unflatten/Identity, Dropout(p=0): no arithmetic, dtype passes through unchanged
    OTHER = "other"  # any other module with parameters (user-defined leaves)
    FUNCTIONAL = "functional"  # a module with children whose own forward computes (SDPA, einsum, matmul between them)


#: The kinds that are compute operators by class (matmul, convolution, attention, recurrent, embeddings, other modules
#: with weights): what a user's type rule names.
COMPUTE_CLASS_KINDS = (OperatorKind.COMPUTE, OperatorKind.EMBEDDING, OperatorKind.OTHER)
#: The kinds always judged by their own cost: those, and containers computing between their children.
JUDGED_KINDS = (*COMPUTE_CLASS_KINDS, OperatorKind.FUNCTIONAL)

_ATOMIC_TYPES: set[type[nn.Module]] = {nn.RNNBase, nn.MultiheadAttention}
# Modules of libraries people train, known by qualified class name (nothing is imported), lowered as torch modules
# autocast lowers (autocast, or parameter copies where there is none). Computing as an nn.Linear:
_KNOWN_COMPUTE = frozenset({
    "transformers.pytorch_utils.Conv1D",  # GPT-2's c_attn/c_proj/c_fc: transposed weight, torch.addmm
})
_SHAPE_TYPES: tuple[type[nn.Module], ...] = (nn.Flatten, nn.Unflatten, nn.Identity)
_DROPOUT_TYPES: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                                               nn.FeatureAlphaDropout)
_AUTOCAST_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Bilinear, CONV_BASE, nn.MultiheadAttention)
_WEIGHT_READING_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, CONV_BASE)
_COMPUTE_TYPES: tuple[type[nn.Module], ...] = (*_AUTOCAST_TYPES, nn.RNNBase)
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    NORM_BASE,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
_INPUT_ONLY_NORMS: tuple[type[nn.Module], ...] = (BATCH_NORM_BASE, nn.LocalResponseNorm)
_EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


def register_atomic(module_type: type[nn.Module]) -> type[nn.Module]:
    """Treat every module of ``module_type`` (and its subclasses) as one operator, children included.

    Use it for modules whose forward must run in one precision as a whole (fused blocks, custom kernels with
    parameters of their own). Can be used as a class decorator.

    Raises:
        ConfigError: if ``module_type`` is not a subclass of ``torch.nn.Module``.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise ConfigError(f"register_atomic expects a torch.nn.Module subclass, got {module_type!r}.")
    _ATOMIC_TYPES.add(module_type)
    return module_type


_CLASS_NAMES: dict[type, frozenset[str]] = {}


def _class_names(cls: type) -> frozenset[str]:
    """The qualified names of ``cls`` and its base classes (computed once per class)."""
    names = _CLASS_NAMES.get(cls)
    if names is None:
        names = _CLASS_NAMES[cls] = frozenset(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__)
    return names


def _known(module: nn.Module, table: frozenset[str]) -> bool:
    """Whether ``module``'s class (or a base class) is in ``table`` (qualified class names)."""
    return not _class_names(type(module)).isdisjoint(table)


def is_atomic(module: nn.Module) -> bool:
    """Whether ``module`` is one operator with everything inside it (recurrent, attention, registered)."""
    return isinstance(module, tuple(_ATOMIC_TYPES))


def is_recurrent(module: nn.Module) -> TypeGuard[nn.RNNBase]:
    """Whether ``module`` is an ``nn.LSTM``/``GRU``/``RNN``."""
    return isinstance(module, nn.RNNBase)


def autocast_like(module: nn.Module) -> bool:
    """Whether ``module`` computes as a torch module autocast lowers (matmul, conv, attention), or is a module whose
    own functional work (found by tracing) only an autocast region can lower."""
    return isinstance(module, _AUTOCAST_TYPES) or _known(module, _KNOWN_COMPUTE) or is_functional(module)


def is_functional(module: nn.Module) -> bool:
    """Whether ``module`` has children and a trace found it computing matmuls, convolutions, attention or recurrent
    cells itself (an operator of kind ``FUNCTIONAL``)."""
    return not isinstance(module, tuple(_ATOMIC_TYPES)) and owns_planned_work(module)


def weight_reading(module: nn.Module) -> bool:
    """Whether ``module`` is a ``Linear``/``Conv`` (or computes as one): an autocast-lowered operator whose forward
    reads its own weight and bias, so its 16-bit copies can be made by the executor (and re-cast in backward)."""
    return isinstance(module, _WEIGHT_READING_TYPES) or _known(module, _KNOWN_COMPUTE)


def linear_sizes(module: nn.Module) -> tuple[int, int] | None:
    """``(in features, out features)`` of an operator that computes one linear map of its input with its 2-D weight:
    an ``nn.Linear`` (``F.linear``), or Hugging Face's ``Conv1D`` (``torch.addmm`` with the weight transposed, of
    shape ``(in, out)``); ``None`` for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if _known(module, _KNOWN_COMPUTE) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def normalises_input_only(module: nn.Module) -> bool:
    """Whether ``module`` is a norm whose kernels take a 16-bit input with FP32 parameters on every device
    (batch norms, local response norm; CUDA's LayerNorm/GroupNorm kernels refuse mixed dtypes)."""
    return isinstance(module, _INPUT_ONLY_NORMS)


def does_no_arithmetic(module: nn.Module) -> bool:
    """Whether ``module`` computes nothing (shape-only modules, a dropout with ``p=0``): its output has its input's
    dtype whatever the plan says, so it is never a decision of its own (it follows its neighbours)."""
    return isinstance(module, _SHAPE_TYPES) or (isinstance(module, _DROPOUT_TYPES) and float(getattr(module, "p", 1))
                                                == 0.0)


def judged_as_compute(module: nn.Module) -> bool:
    """Whether a search judges lowering ``module`` by what it costs itself (forward and backward), as a compute
    operator: matmul, convolution, attention and recurrent modules, embeddings, other modules with weights, containers
    computing between their children, and any leaf a trace found running matmul, convolution, attention or recurrent
    kernels, whatever its class (a parameter-free leaf calling ``scaled_dot_product_attention``). The others (norms,
    activations) are cheap operators, lowered between lowered neighbours where that pays."""
    return classify(module) in JUDGED_KINDS or runs_planned_work(module)


def classify(module: nn.Module) -> OperatorKind:
    """The :class:`OperatorKind` of an operator module."""
    if is_functional(module):
        return OperatorKind.FUNCTIONAL
    if isinstance(module, _COMPUTE_TYPES) or autocast_like(module):
        return OperatorKind.COMPUTE
    if isinstance(module, _NORM_TYPES):
        return OperatorKind.NORM
    if isinstance(module, _EMBEDDING_TYPES):
        return OperatorKind.EMBEDDING
    if does_no_arithmetic(module):
        return OperatorKind.SHAPE
    if any(True for _ in module.parameters()):
        return OperatorKind.OTHER
    return OperatorKind.ELEMENTWISE
