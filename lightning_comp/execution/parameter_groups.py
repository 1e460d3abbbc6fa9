"""Which operator owns each parameter: the unit a plan's optimizer-state and master-weight entries apply to.

A parameter belongs to the innermost operator (:func:`~lightning_comp.operators.discovery.iter_operators`) whose
module holds it, directly or through children of an atomic operator. A parameter held by a module that is no
operator (a positional embedding registered on a container) has no owner: the plan's ``state_default`` and
``master_default`` apply to it. A parameter shared by several modules (tied embeddings) is listed once, under its
first name.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_comp.operators.discovery import iter_operators, operator_name

__all__ = ["OwnedParameter", "parameter_owners"]


@dataclass(frozen=True)
class OwnedParameter:
    """A parameter and the operator that owns it.

    Attributes:
        name: the parameter's qualified name (without the levels wrappers insert).
        parameter: the parameter.
        owner: the owning operator's name, or ``None`` when no operator holds it.
        owner_type: the owning operator's class (for ``type:`` selectors), or ``None``.
    """

    name: str
    parameter: nn.Parameter
    owner: str | None
    owner_type: type[nn.Module] | None


def parameter_owners(model: nn.Module) -> list[OwnedParameter]:
    """Every parameter of ``model`` (each once) with the operator that owns it, in ``named_parameters()`` order."""
    operators = {name: module for name, module in iter_operators(model)}
    owned = []
    for qualified, parameter in model.named_parameters():
        name = operator_name(qualified)
        path = name.split(".")[:-1]
        owner: str | None = None
        for depth in range(len(path), -1, -1):
            candidate = ".".join(path[:depth])
            if candidate in operators:
                owner = candidate
                break
        owned.append(OwnedParameter(name, parameter, owner, None if owner is None else type(operators[owner])))
    return owned
