"""Operators: the units of work a precision plan assigns a precision to.

An *operator* is a module found by ``named_modules()`` that does the work itself: every leaf module, plus modules
that must be treated whole because their forward is one fused kernel or uses parameters of its own next to its
children (``nn.LSTM``/``nn.GRU``/``nn.RNN``, ``nn.MultiheadAttention`` and anything registered with
:func:`register_atomic`). Containers (``nn.Sequential``, blocks, the LightningModule itself) are not operators,
and nothing inside an atomic operator is one either.

A few modules of libraries people train are known by class name (nothing is imported): Hugging Face's ``Conv1D``
computes as an ``nn.Linear`` and is lowered as one; ``GPT2Attention`` is atomic, like ``nn.MultiheadAttention``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from lightning_comp.devices.device_class import model_device
from lightning_comp.devices.kernel_probes import recurrent_lowering
from lightning_comp.numerics.precision import Precision

__all__ = [
    "OperatorKind",
    "Lowering",
    "OperatorInfo",
    "register_atomic",
    "discover_operators",
    "iter_operators",
    "classify",
    "lowering_for",
]


class OperatorKind(str, Enum):
    """What an operator does, which decides how low precision can apply to it."""

    COMPUTE = "compute"  # matmul/conv/recurrent/attention: the ops low precision speeds up
    NORM = "norm"  # BatchNorm/LayerNorm/GroupNorm/...: low-precision input, FP32 statistics
    ELEMENTWISE = "elementwise"  # parameter-free activations, dropout, pooling, softmax, padding, ...
    EMBEDDING = "embedding"  # table look-ups
    SHAPE = "shape"  # Flatten/Unflatten/Identity: no arithmetic, dtype passes through unchanged
    OTHER = "other"  # any other module with parameters (user-defined leaves)


class Lowering(str, Enum):
    """How a low precision is put into effect for one operator (master weights always stay FP32)."""

    AUTOCAST = "autocast"  # a torch.autocast region around the call: weights cast per call, FP32 grads
    INPUT = "input"  # floating inputs cast to the low dtype; parameters/statistics stay FP32 (mixed kernels)
    PARAMS = "params"  # inputs cast and the forward run with low-precision copies of the FP32 parameters
    OUTPUT = "output"  # computed in FP32, output emitted in the low dtype (look-ups: identical numerics, cheaper)
    NONE = "none"  # nothing to lower: precision passes through


_ATOMIC_TYPES: set[type[nn.Module]] = {nn.RNNBase, nn.MultiheadAttention}
# Modules of libraries people train, known by qualified class name (nothing is imported), lowered as torch modules
# autocast lowers (autocast, or parameter copies where there is none). Computing as an nn.Linear:
_KNOWN_COMPUTE = frozenset({
    "transformers.pytorch_utils.Conv1D",  # GPT-2's c_attn/c_proj/c_fc: transposed weight, torch.addmm
})
# ... and treated whole, like nn.MultiheadAttention: their attention product is a functional call
# (scaled_dot_product_attention) between their projections, which no operator hook of a child would ever see.
_KNOWN_ATOMIC = frozenset({
    "transformers.models.gpt2.modeling_gpt2.GPT2Attention",
})
_SHAPE_TYPES: tuple[type[nn.Module], ...] = (nn.Flatten, nn.Unflatten, nn.Identity)
_AUTOCAST_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.modules.conv._ConvNd,
    nn.MultiheadAttention,
)
_COMPUTE_TYPES: tuple[type[nn.Module], ...] = (*_AUTOCAST_TYPES, nn.RNNBase)
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
_INPUT_ONLY_NORMS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm, nn.LocalResponseNorm)
_EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


def register_atomic(module_type: type[nn.Module]) -> type[nn.Module]:
    """Treat every module of ``module_type`` (and its subclasses) as one operator, children included.

    Use it for modules whose forward must run in one precision as a whole (fused blocks, custom kernels with
    parameters of their own). Can be used as a class decorator.

    Raises:
        TypeError: if ``module_type`` is not a subclass of ``torch.nn.Module``.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_atomic expects a torch.nn.Module subclass, got {module_type!r}.")
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


def _is_atomic(module: nn.Module) -> bool:
    return isinstance(module, tuple(_ATOMIC_TYPES)) or _known(module, _KNOWN_ATOMIC)


def _autocast_like(module: nn.Module) -> bool:
    """Whether ``module`` computes as a torch module autocast lowers (matmul, conv, attention)."""
    return (isinstance(module, _AUTOCAST_TYPES) or _known(module, _KNOWN_COMPUTE)
            or _known(module, _KNOWN_ATOMIC))


def weight_reading(module: nn.Module) -> bool:
    """Whether ``module`` is a ``Linear``/``Conv`` (or computes as one): an autocast-lowered operator whose forward
    reads its own weight and bias, so its 16-bit copies can be made by the executor (and re-cast in backward)."""
    return isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) or _known(module, _KNOWN_COMPUTE)


def classify(module: nn.Module) -> OperatorKind:
    """The :class:`OperatorKind` of an operator module."""
    if isinstance(module, _COMPUTE_TYPES) or _autocast_like(module):
        return OperatorKind.COMPUTE
    if isinstance(module, _NORM_TYPES):
        return OperatorKind.NORM
    if isinstance(module, _EMBEDDING_TYPES):
        return OperatorKind.EMBEDDING
    if isinstance(module, _SHAPE_TYPES):
        return OperatorKind.SHAPE
    if any(True for _ in module.parameters()):
        return OperatorKind.OTHER
    return OperatorKind.ELEMENTWISE


def lowering_for(module: nn.Module, precision: Precision, device: torch.device | str) -> Lowering | None:
    """How ``precision`` is put into effect for ``module`` on ``device`` (a device, or a device type string).

    Returns ``Lowering.NONE`` for FP32 and for shape-only operators, and ``None`` when no way of lowering the operator
    runs on that device. Recurrent operators are decided by trying each way on a tiny copy on the device
    (:mod:`lightning_comp.devices.kernel_probes`): CPU autocast cannot run a BF16 ``nn.LSTM`` on AVX2-only CPUs, where
    BF16 parameter copies can.
    """
    kind = classify(module)
    if precision is Precision.FP32 or kind is OperatorKind.SHAPE:
        return Lowering.NONE
    target = torch.device(device)
    if isinstance(module, nn.RNNBase):
        route = recurrent_lowering(module, precision, target)
        return None if route is None else Lowering(route)
    if _autocast_like(module):  # where torch has no autocast, parameter copies do the same work
        return Lowering.AUTOCAST if _autocast_available(target.type) else Lowering.PARAMS
    if kind is OperatorKind.NORM:
        # CPU kernels accept a 16-bit input with FP32 affine parameters; CUDA LayerNorm/GroupNorm do not.
        if isinstance(module, _INPUT_ONLY_NORMS) or target.type == "cpu":
            return Lowering.INPUT
        return Lowering.PARAMS
    if kind is OperatorKind.EMBEDDING:
        return Lowering.OUTPUT
    if kind is OperatorKind.ELEMENTWISE:
        return Lowering.INPUT
    return Lowering.PARAMS


def _autocast_available(device_type: str) -> bool:
    available = getattr(torch.amp, "is_autocast_available", None)  # public since torch 2.4
    return device_type in ("cpu", "cuda") if available is None else bool(available(device_type))


@dataclass(frozen=True)
class OperatorInfo:
    """One operator of a model, as :func:`discover_operators` reports it.

    Attributes:
        name: fully qualified module name (as in ``named_modules()``).
        type_name: the module's class name.
        kind: what the operator does.
        num_params: number of parameter elements the operator owns (children of atomic operators included).
        lowerable: whether a low precision can apply to it at all (shape-only operators pass dtypes through).
    """

    name: str
    type_name: str
    kind: OperatorKind
    num_params: int
    lowerable: bool


_COMPILED_WRAPPER = "_orig_mod"  # the attribute under which torch.compile's OptimizedModule holds the module


def operator_name(qualified: str) -> str:
    """The plan's name for the module at ``qualified`` (a ``named_modules()`` name): the wrapper level that
    ``torch.compile`` inserts (``net._orig_mod.0``) is left out, so a plan names the same operators whether or not a
    submodule is compiled (``net.0``)."""
    if _COMPILED_WRAPPER not in qualified:
        return qualified
    return ".".join(part for part in qualified.split(".") if part != _COMPILED_WRAPPER)


def iter_operators(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(name, module)`` for every operator of ``model``, in ``named_modules()`` order.

    Names are those of ``named_modules()`` without the level ``torch.compile`` inserts (see :func:`operator_name`).
    """
    skip_prefixes: list[str] = []
    for qualified, module in model.named_modules():
        name = operator_name(qualified)
        if any(name.startswith(prefix) for prefix in skip_prefixes):
            continue
        if _is_atomic(module):
            skip_prefixes.append(name + "." if name else "")  # a root atomic module: none of its children
            yield name, module
            continue
        if next(module.children(), None) is None:
            yield name, module


def discover_operators(model: nn.Module) -> list[OperatorInfo]:
    """List the operators of ``model``: name, type, parameter count and whether low precision can apply.

    A model that is itself a single leaf module (e.g. a bare ``nn.Linear``) has one operator named ``""``.
    """
    infos = []
    for name, module in iter_operators(model):
        kind = classify(module)
        num_params = sum(p.numel() for p in module.parameters())
        infos.append(OperatorInfo(name, type(module).__name__, kind, num_params, kind is not OperatorKind.SHAPE))
    return infos


def has_floating_work(model: nn.Module) -> bool:
    """Whether ``model`` has at least one operator low precision can apply to."""
    return any(info.lowerable for info in discover_operators(model))


def module_device_type(module: nn.Module, default: str = "cpu") -> str:
    """The device type of the first parameter or buffer of ``module`` (``default`` if it has none)."""
    return model_device(module, default).type


def is_floating(tensor: object) -> bool:
    """Whether ``tensor`` is a floating-point tensor."""
    return isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
