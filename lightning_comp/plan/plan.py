"""The precision plan: an immutable assignment of a value in every dimension to each operator of a model.

Each dimension (:mod:`lightning_comp.plan.dimensions`) is a set of *entries* ``selector -> value`` plus a default.
Selectors (exact operator names, globs,
``"type:ClassName"``) and their precedence are described in :mod:`lightning_comp.plan.selectors`; any entry beats the
default.

Plans made for a model (:meth:`PrecisionPlan.for_model`, or any plan a search produces) carry the model's operator
fingerprint, the torch version and the class of the device they were made on
(:class:`~lightning_comp.devices.DeviceClass`), so that applying them to another model fails loudly, and applying them
on a device where their 16-bit precision is emulated warns. Their file format is :mod:`lightning_comp.plan.serialised`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from lightning_comp.common.plain import plain
from lightning_comp.common.tables import format_table
from lightning_comp.devices.device_classes import DeviceClass, device_class, model_device
from lightning_comp.errors import PlanError, PlanFileError, PlanMismatchError
from lightning_comp.numerics.precision import parse_precision
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.operators.kinds import OperatorKind, classify
from lightning_comp.plan.dimensions import DEFAULT_DECIDER, Assignment, Dimension
from lightning_comp.plan.entries import split_defaults, split_entries
from lightning_comp.plan.fingerprint import OperatorFingerprint
from lightning_comp.plan.serialised import document_fields, is_document, plan_document, read_document, write_document

__all__ = ["PlanLike", "PrecisionPlan", "plan_from_any"]

@dataclass(frozen=True)
class PrecisionPlan:
    """An immutable assignment of a value in every :class:`~lightning_comp.plan.dimensions.Dimension` to each operator
    of a model.

    The dimensions are independent: the precision an operator computes in (``compute``: fp32/bf16/fp16); how the
    tensors it saves for backward are stored (``saved``: fp32 as computed, bf16, fp8, or ``recompute``); and, for the
    parameters it owns (:func:`~lightning_comp.execution.parameter_groups.parameter_owners`), the precision of their
    optimizer state (``state``: fp32/bf16/8bit) and of their master copy (``master``: fp32/bf16). ``plan[dimension]``
    is that dimension's :class:`~lightning_comp.plan.dimensions.Assignment`, ``plan.of(dimension, name)`` one
    operator's value, and :meth:`with_assignment` the one way to change a copy. Build a plan with :meth:`from_dict`,
    :meth:`for_model` or :meth:`load`; never mutate it.

    Attributes:
        assignments: one :class:`~lightning_comp.plan.dimensions.Assignment` per dimension, in the enum's order
            (given any subset, in any order, as assignments or as ``{dimension: {selector: value}}``).
        fingerprint: operators of the model the plan was made for, or ``None`` for a model-independent plan.
        torch_version: torch version the plan was made with, if bound to a model.
        device_type: device type (``"cpu"``, ``"cuda"``) the plan was made for, if bound to a model.
        provenance: free-form JSON-able notes (who made the plan and from what evidence); not part of equality.
        device: the class of the device the plan was made on (CPU capability, CUDA compute capability, which
            16-bit precisions are native there), if bound to a model.
    """

    assignments: tuple[Assignment, ...] = ()
    fingerprint: OperatorFingerprint | None = None
    torch_version: str | None = None
    device_type: str | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    device: DeviceClass | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        given: dict[Dimension, Assignment] = {}
        raw = self.assignments.items() if isinstance(self.assignments, Mapping) else (
            (a.dimension, a) if isinstance(a, Assignment) else a for a in self.assignments)
        for key, value in raw:
            dimension = Dimension.parse(key)
            if dimension in given:
                raise PlanError(f"Plan assignments name the dimension {dimension.value!r} twice.")
            given[dimension] = value if isinstance(value, Assignment) else Assignment(dimension, value)
        object.__setattr__(self, "assignments", tuple(given.get(d) or Assignment(d) for d in Dimension))
        object.__setattr__(self, "provenance", MappingProxyType(dict(self.provenance)))
        for name in ("torch_version", "device_type"):  # plain str: checkpoints must load with weights_only=True
            value = getattr(self, name)
            object.__setattr__(self, name, None if value is None else str.__str__(value))

    def __reduce__(self) -> tuple[Any, ...]:
        # The read-only provenance view cannot be pickled or deep-copied (ddp_spawn pickles the plugin): rebuild.
        return (type(self), (self.assignments, self.fingerprint, self.torch_version, self.device_type,
                             dict(self.provenance), self.device))

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], default: object = "fp32") -> PrecisionPlan:
        """Build a plan from ``{selector: value}``, or from the dictionary :meth:`to_dict` wrote.

        An entry's value is a compute precision (``"bf16"``), or a mapping that sets any of the dimensions
        (``{"compute": "bf16", "saved": "fp8", "state": "8bit", "master": "bf16"}``, or ``{"saved": "recompute"}``).

        Args:
            mapping: selector -> value (see the module docstring for selectors), or a serialised plan.
            default: the value of operators no entry matches: a compute precision, or a mapping that sets the
                default of any of the dimensions (``{"compute": "bf16", "saved": "bf16"}``); ignored for a
                serialised plan.

        Raises:
            PlanError: on an unknown value, a malformed selector or a malformed serialised plan.
        """
        if not isinstance(mapping, Mapping):
            raise PlanError(f"A plan must be built from a mapping, got {type(mapping).__name__}: {mapping!r}.")
        if is_document(mapping):
            return cls(**document_fields(mapping))
        defaults = split_defaults(default)
        return cls(tuple(Assignment(dimension, tuple(entries.items()), defaults.get(dimension))
                         for dimension, entries in split_entries(mapping).items()))

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        mapping: Mapping[str, Any] | None = None,
        default: object = "fp32",
        provenance: Mapping[str, Any] | None = None,
    ) -> PrecisionPlan:
        """Build a plan for ``model``: validate the entries against it and record its fingerprint.

        Raises:
            PlanMismatchError: if an entry matches no operator of ``model``.
        """
        plan = cls.from_dict(mapping or {}, default=default)
        plan = replace(plan, provenance=dict(provenance or plan.provenance))
        return plan.bind(model)

    def bind(self, model: nn.Module, device: torch.device | str | None = None) -> PrecisionPlan:
        """Validate this plan against ``model`` and return it with the model's fingerprint, torch version and device.

        Args:
            model: the model the plan is for.
            device: where the model computes (default: where its parameters are now). A plan that already records a
                device keeps it: it says where the plan was made.

        Raises:
            PlanMismatchError: if an entry matches no operator, or the plan was made for a different model.
        """
        self.validate(model)
        target = model_device(model) if device is None else torch.device(device)
        fresh = self.device_type is None and self.device is None
        return replace(
            self,
            fingerprint=OperatorFingerprint.of(model),
            torch_version=self.torch_version or torch.__version__,
            device_type=target.type if fresh else self.device_type,
            device=device_class(target) if fresh else self.device,
            provenance=dict(self.provenance),
        )

    def with_assignment(self, dimension: Dimension | str, updates: Mapping[str, Any],
                        default: object | None = None) -> PrecisionPlan:
        """A copy with ``updates`` (selector -> value of ``dimension``) added to that dimension's entries (overriding
        entries of the same selector), and ``default`` as its default if given."""
        dimension = Dimension.parse(dimension)
        assignments = tuple(a.updated(updates, default) if a.dimension is dimension else a for a in self.assignments)
        return replace(self, assignments=assignments, provenance=dict(self.provenance))

    def with_provenance(self, **notes: Any) -> PrecisionPlan:
        """A copy with ``notes`` added to :attr:`provenance`."""
        return replace(self, provenance={**self.provenance, **notes})

    # -------------------------------------------------------------------------------------------------- queries
    def __getitem__(self, dimension: Dimension | str) -> Assignment:
        """The assignment of ``dimension``."""
        return self.assignments[_ORDER[Dimension.parse(dimension)]]

    def of(self, dimension: Dimension | str, name: str, module_type: type | None = None) -> Any:
        """The value in ``dimension`` of the operator called ``name`` (of class ``module_type``, for type selectors)."""
        return self[dimension].of(name, module_type)

    def same_assignments(self, other: PrecisionPlan) -> bool:
        """Whether ``other`` assigns every operator the same values (fingerprint, versions and notes aside)."""
        return self.assignments == other.assignments

    @property
    def is_all_fp32(self) -> bool:
        """Whether every operator computes in FP32 under this plan."""
        return not self[Dimension.COMPUTE].changes

    @property
    def compresses_saved(self) -> bool:
        """Whether any operator saves its tensors for backward in a lower precision than computed."""
        return any(value.compresses for value in self[Dimension.SAVED].values())

    @property
    def recomputes(self) -> bool:
        """Whether any operator's output is recomputed in backward instead of stored."""
        return any(value.recomputes for value in self[Dimension.SAVED].values())

    @property
    def manages_parameters(self) -> bool:
        """Whether any operator's parameters keep their optimizer state or master copy other than in FP32."""
        return self[Dimension.STATE].changes or self[Dimension.MASTER].changes

    def uses(self, precision: object) -> bool:
        """Whether the compute precision ``precision`` appears in the plan (as an entry or the default)."""
        wanted = parse_precision(precision)
        return any(value is wanted for value in self[Dimension.COMPUTE].values())

    def resolve(self, model: nn.Module, dimension: Dimension | str = Dimension.COMPUTE) -> dict[str, Any]:
        """The value in ``dimension`` of every operator of ``model`` (shape-only operators included)."""
        assignment = self[dimension]
        return {name: assignment.of(name, type(module)) for name, module in iter_operators(model)}

    def explain(self, model: nn.Module, dimension: Dimension | str = Dimension.COMPUTE) -> dict[str, str]:
        """For every operator, the selector that decided its value in ``dimension`` (``"<default>"`` if none)."""
        return self[dimension].explain(model)

    def unmatched_entries(self, model: nn.Module) -> list[str]:
        """Selectors of this plan (of any dimension) that match no operator of ``model``."""
        return sorted({s for assignment in self.assignments for s in assignment.selectors.unmatched(model)})

    def validate(self, model: nn.Module) -> None:
        """Check the plan fits ``model``.

        Raises:
            PlanMismatchError: naming every entry that matches no operator (with close operator names), or the
                operators that differ when the plan was made for another model.
        """
        if self.fingerprint is not None:
            current = OperatorFingerprint.of(model)
            if current != self.fingerprint:
                raise PlanMismatchError(
                    f"This plan was made for a different model (fingerprint {self.fingerprint.digest}, the model's is"
                    f" {current.digest}): {self.fingerprint.difference(current)}. Make a new plan for this model,"
                    " or drop the fingerprint with `PrecisionPlan.from_dict(plan.to_dict()['entries'])`."
                )
        for assignment in self.assignments:
            dimension = assignment.dimension
            noun = "" if dimension is Dimension.COMPUTE else dimension.what.removesuffix(" precision") + " "
            what = f"{noun}plan entr"
            assignment.selectors.validate(model, what=what)

    def low_operators(self, model: nn.Module) -> list[str]:
        """Names of the operators of ``model`` this plan runs in a 16-bit precision (shape-only ones excluded)."""
        return [
            name
            for name, module in iter_operators(model)
            if self.of(Dimension.COMPUTE, name, type(module)).is_low and classify(module) is not OperatorKind.SHAPE
        ]

    # -------------------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dictionary (plain Python types only) that :meth:`from_dict` turns back into this plan
        (the document of :mod:`lightning_comp.plan.serialised`)."""
        return plan_document(self.assignments, self.fingerprint, self.torch_version, self.device_type, self.device,
                             self.provenance)

    def to_json(self) -> str:
        """The plan as an indented JSON document."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON to ``path`` (atomically; parent folders are created) and return the path."""
        return write_document(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrecisionPlan:
        """Read a plan written by :meth:`save` (or a plain ``{selector: precision}`` JSON object).

        Raises:
            PlanFileError: if the file is missing, unreadable, not JSON, or JSON of the wrong shape.
        """
        data = read_document(path)
        try:
            return cls.from_dict(data)
        except PlanError as err:
            raise PlanFileError(f"Plan file {str(path)!r}: {err}") from None

    # ------------------------------------------------------------------------------------------------- display
    def _shown(self) -> list[Assignment]:
        """The compute assignment, then every other dimension's that changes anything."""
        return [a for a in self.assignments if a.dimension is Dimension.COMPUTE or a.changes]

    def summary(self, model: nn.Module | None = None) -> str:
        """A readable table of the plan; with ``model``, one row per operator: its value in the compute dimension and
        in every other dimension the plan changes, and the selectors that decided them."""
        shown = self._shown()
        columns = tuple("precision" if a.dimension is Dimension.COMPUTE else a.dimension.value for a in shown)
        if model is None:
            entries = [dict(a.entries) for a in shown]
            selectors = sorted(set().union(*entries))
            rows: list[tuple[str, ...]] = [(s, *(e[s].value if s in e else "-" for e in entries)) for s in selectors]
            rows.append((DEFAULT_DECIDER, *(a.default.value for a in shown)))
            return format_table(("selector", *columns), rows)
        rows = []
        for name, module in iter_operators(model):
            params = sum(p.numel() for p in module.parameters())
            kind = type(module)
            deciders = list(dict.fromkeys(a.decider(name, kind) for a in shown))  # distinct, in column order
            rows.append((name or "<root>", kind.__name__, f"{params:,}", *(a.of(name, kind).value for a in shown),
                         " / ".join(deciders)))
        header = ("operator", "type", "params", *columns, "decided by")
        tail = f"{sum(1 for r in rows if r[3] != 'fp32')} of {len(rows)} operators in 16-bit precision"
        for offset, assignment in enumerate(shown[1:], start=4):
            tail += f", {sum(1 for r in rows if r[offset] != 'fp32')} {_CHANGED[assignment.dimension]}"
        return format_table(header, rows) + "\n" + tail

    def __repr__(self) -> str:
        parts = []
        for assignment in self._shown():
            entries = "{" + ", ".join(f"{s!r}: {p.value!r}" for s, p in assignment.entries) + "}"
            if assignment.dimension is Dimension.COMPUTE:
                parts += [entries, f"default={assignment.default.value!r}"]
            else:
                key = assignment.dimension.value
                parts += [f"{key}={entries}", f"{key}_default={assignment.default.value!r}"]
        bound = f", fingerprint={self.fingerprint.digest}" if self.fingerprint else ""
        return f"PrecisionPlan({', '.join(parts)}{bound})"


_ORDER = {dimension: index for index, dimension in enumerate(Dimension)}
_CHANGED = {  # what a non-fp32 value of each dimension does, for the summary's last line
    Dimension.SAVED: "save for backward in bf16/fp8 or recompute",
    Dimension.STATE: "keep optimizer state in bf16/8bit",
    Dimension.MASTER: "keep bf16 master weights",
}


PlanLike = PrecisionPlan | Mapping[str, Any] | str | os.PathLike[str] | None


def plan_from_any(plan: PlanLike) -> PrecisionPlan:
    """Accept a plan, a ``{selector: precision}`` mapping, a path to a saved plan, or ``None`` (all FP32)."""
    if plan is None:
        return PrecisionPlan()
    if isinstance(plan, PrecisionPlan):
        return plan
    if isinstance(plan, Mapping):
        return PrecisionPlan.from_dict(plain(plan))
    if isinstance(plan, (str, os.PathLike)):
        return PrecisionPlan.load(plan)
    raise PlanError(
        f"Cannot make a plan from {type(plan).__name__} {plan!r}: pass a PrecisionPlan, a mapping"
        " {selector: precision}, a path to a saved plan, or None."
    )

