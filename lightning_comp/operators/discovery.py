"""Finding a model's operators: the modules a precision plan names (see :mod:`lightning_comp.operators.kinds`).

Containers (``nn.Sequential``, blocks, the LightningModule itself) are not operators, and nothing inside an atomic
operator is one either. Operator names are those of ``named_modules()`` without the level ``torch.compile`` inserts,
so one plan fits a model compiled or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from lightning_comp.adapters.torch_internals import COMPILED_WRAPPER_ATTRIBUTE
from lightning_comp.operators.kinds import OperatorKind, classify, is_atomic

__all__ = ["OperatorInfo", "discover_operators", "iter_operators", "operator_name"]


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
    """The plan's name for the module at ``qualified`` (a ``named_modules()`` name): the wrapper level that
    ``torch.compile`` inserts (``net._orig_mod.0``) is left out, so a plan names the same operators whether or not a
    submodule is compiled (``net.0``)."""
    if COMPILED_WRAPPER_ATTRIBUTE not in qualified:
        return qualified
    return ".".join(part for part in qualified.split(".") if part != COMPILED_WRAPPER_ATTRIBUTE)


def iter_operators(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(name, module)`` for every operator of ``model``, in ``named_modules()`` order.

    Names are those of ``named_modules()`` without the level ``torch.compile`` inserts (see :func:`operator_name`).
    """
    skip_prefixes: list[str] = []
    for qualified, module in model.named_modules():
        name = operator_name(qualified)
        if any(name.startswith(prefix) for prefix in skip_prefixes):
            continue
        if is_atomic(module):
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
