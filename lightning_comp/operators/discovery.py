"""Finding a model's operators: the modules a precision plan names (see :mod:`lightning_comp.operators.kinds`).

Containers (``nn.Sequential``, blocks, the LightningModule itself) are not operators unless a trace found them
computing between their children (:mod:`lightning_comp.operators.owned_work`); nothing inside an atomic operator is
one; an empty ``nn.ModuleList``/``ModuleDict``/``Sequential`` is none either. Operator names are those of
``named_modules()`` without the level ``torch.compile`` inserts, so one plan fits a model compiled or not.

Until a model's first step is traced, its containers that may turn out to compute are *untraced*
(:func:`iter_untraced_containers`): plan entries naming them are checked once the trace has run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from lightning_comp.adapters.torch_internals import FSDP2_MODULE, WRAPPER_ATTRIBUTES
from lightning_comp.operators.kinds import OperatorKind, classify, is_atomic, is_functional
from lightning_comp.operators.owned_work import was_traced

__all__ = ["OperatorInfo", "discover_operators", "iter_operators", "iter_untraced_containers", "operator_name",
           "operator_type"]

# Containers by type: with no children they hold and compute nothing (an empty ModuleList is no operator).
_EMPTY_CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList,
                                                  nn.ParameterDict)


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


def operator_name(qualified: str) -> str:
    """The plan's name for the module at ``qualified`` (a ``named_modules()`` name): the levels wrappers insert
    (``torch.compile``'s ``_orig_mod``, FSDP1's ``_fsdp_wrapped_module``, activation checkpointing's
    ``_checkpoint_wrapped_module``) are left out, so one plan names the same operators wrapped or not."""
    parts = qualified.split(".")
    if WRAPPER_ATTRIBUTES.isdisjoint(parts):
        return qualified
    return ".".join(part for part in parts if part not in WRAPPER_ATTRIBUTES)


def operator_type(module: nn.Module) -> type[nn.Module]:
    """The class a plan knows ``module`` by: its own, or, for a module FSDP2 sharded (whose class it swapped for
    ``FSDP<Class>``), the class it had."""
    cls = type(module)
    if FSDP2_MODULE is not None and isinstance(module, FSDP2_MODULE):
        for base in cls.__mro__[1:]:
            if not issubclass(base, FSDP2_MODULE) and issubclass(base, nn.Module):
                return base
    return cls


def iter_operators(model: nn.Module, *, traced: bool = True) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(name, module)`` for every operator of ``model``, in ``named_modules()`` order (a ``FUNCTIONAL``
    operator before its children).

    Names are those of ``named_modules()`` without the level ``torch.compile`` inserts (see :func:`operator_name`).

    Args:
        model: the model.
        traced: include the modules a trace found computing between their children (``False``: only what the module
            tree alone says, as the plan's fingerprint records it).
    """
    for name, module, kind in _walk(model):
        if kind == "operator" or (kind == "functional" and traced):
            yield name, module


def iter_untraced_containers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(name, module)`` for the containers of ``model`` that may compute between their children but have
    not been traced yet (before the model's first step under a :class:`~lightning_comp.CoMPPrecision`)."""
    for name, module, kind in _walk(model):
        if kind == "untraced":
            yield name, module


def _walk(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """Every module outside atomic operators, as ``"operator"``, ``"functional"``, ``"untraced"`` (a container not
    traced yet) or ``"container"``; empty containers are left out."""
    skip_prefixes: list[str] = []
    for qualified, module in model.named_modules():
        name = operator_name(qualified)
        if any(name.startswith(prefix) for prefix in skip_prefixes):
            continue
        if is_atomic(module):
            skip_prefixes.append(name + "." if name else "")  # a root atomic module: none of its children
            yield name, module, "operator"
            continue
        if next(module.children(), None) is None:
            if not isinstance(module, _EMPTY_CONTAINERS):
                yield name, module, "operator"
            continue
        if is_functional(module):
            yield name, module, "functional"
        else:
            yield name, module, "container" if was_traced(module) else "untraced"


def discover_operators(model: nn.Module) -> list[OperatorInfo]:
    """List the operators of ``model``: name, type, parameter count and whether low precision can apply.

    A model that is itself a single leaf module (e.g. a bare ``nn.Linear``) has one operator named ``""``.
    """
    infos = []
    for name, module in iter_operators(model):
        kind = classify(module)
        num_params = sum(p.numel() for p in module.parameters())
        lowerable = kind is not OperatorKind.SHAPE
        infos.append(OperatorInfo(name, operator_type(module).__name__, kind, num_params, lowerable))
    return infos
