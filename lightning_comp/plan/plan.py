"""The precision plan: an immutable assignment of a precision to each operator of a model.

A plan is a set of *entries* ``selector -> precision`` plus a default. Selectors (exact operator names, globs,
``"type:ClassName"``) and their precedence are described in :mod:`lightning_comp.plan.selectors`; any entry beats the
default.

Plans made for a model (:meth:`PrecisionPlan.for_model`, or any plan a search produces) carry the model's operator
fingerprint, the torch version and the class of the device they were made on (:class:`~lightning_comp.DeviceClass`),
so that applying them to another model fails loudly, and applying them on a device where their 16-bit precision is
emulated warns. Their file format is :mod:`lightning_comp.plan.serialised`.
"""

from __future__ import annotations

import functools
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
from lightning_comp.numerics.precision import Precision, SavedPrecision, parse_precision, parse_saved_precision
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.operators.kinds import OperatorKind, classify
from lightning_comp.plan.entries import as_mapping, parse_entries, parse_saved, split_entries
from lightning_comp.plan.fingerprint import OperatorFingerprint
from lightning_comp.plan.selectors import Selectors
from lightning_comp.plan.serialised import (
    PLAN_FORMAT,
    PLAN_VERSION,
    document_fields,
    fingerprint_document,
    is_document,
    read_document,
    write_document,
)

__all__ = ["PlanLike", "PrecisionPlan", "plan_from_any"]

@dataclass(frozen=True)
class PrecisionPlan:
    """An immutable assignment of precisions to each operator of a model.

    Two independent dimensions: the precision an operator computes in (``fp32``/``bf16``/``fp16``), and the
    precision in which the tensors it saves for backward are stored (``fp32`` as computed, ``bf16``, ``fp8``; see
    :class:`~lightning_comp.numerics.precision.SavedPrecision`). Build one with :meth:`from_dict`, :meth:`for_model`
    or :meth:`load`; never mutate it (use :meth:`with_entries` and :meth:`with_saved`).

    Attributes:
        entries: ``(selector, precision)`` pairs of the compute dimension, sorted by selector.
        default: compute precision of every operator that no entry matches.
        fingerprint: operators of the model the plan was made for, or ``None`` for a model-independent plan.
        torch_version: torch version the plan was made with, if bound to a model.
        device_type: device type (``"cpu"``, ``"cuda"``) the plan was made for, if bound to a model.
        provenance: free-form JSON-able notes (who made the plan and from what evidence); not part of equality.
        device: the class of the device the plan was made on (CPU capability, CUDA compute capability, which
            16-bit precisions are native there), if bound to a model.
        saved: ``(selector, saved precision)`` pairs of the saved-for-backward dimension, sorted by selector.
        saved_default: saved precision of every operator that no ``saved`` entry matches.
    """

    entries: tuple[tuple[str, Precision], ...] = ()
    default: Precision = Precision.FP32
    fingerprint: OperatorFingerprint | None = None
    torch_version: str | None = None
    device_type: str | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    device: DeviceClass | None = field(default=None, compare=False, hash=False)
    saved: tuple[tuple[str, SavedPrecision], ...] = ()
    saved_default: SavedPrecision = SavedPrecision.FP32

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", parse_entries(as_mapping(self.entries)))
        object.__setattr__(self, "saved", parse_saved(as_mapping(self.saved)))
        try:
            object.__setattr__(self, "default", parse_precision(self.default))
        except PlanError as err:
            raise PlanError(f"Plan default: {err}") from None
        try:
            object.__setattr__(self, "saved_default", parse_saved_precision(self.saved_default))
        except PlanError as err:
            raise PlanError(f"Plan saved_default: {err}") from None
        object.__setattr__(self, "provenance", MappingProxyType(dict(self.provenance)))
        for name in ("torch_version", "device_type"):  # plain str: checkpoints must load with weights_only=True
            value = getattr(self, name)
            object.__setattr__(self, name, None if value is None else str.__str__(value))

    def __reduce__(self) -> tuple[Any, ...]:
        # The read-only provenance view cannot be pickled or deep-copied (ddp_spawn pickles the plugin): rebuild.
        return (type(self), (self.entries, self.default, self.fingerprint, self.torch_version, self.device_type,
                             dict(self.provenance), self.device, self.saved, self.saved_default))

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], default: object = "fp32", *,
                  saved: Mapping[str, Any] | None = None, saved_default: object = "fp32") -> PrecisionPlan:
        """Build a plan from ``{selector: precision}``, or from the dictionary :meth:`to_dict` wrote.

        An entry's value is a compute precision (``"bf16"``), or a mapping that sets both dimensions
        (``{"compute": "bf16", "saved": "fp8"}``) or one of them (``{"saved": "bf16"}``).

        Args:
            mapping: selector -> precision (see the module docstring for selectors), or a serialised plan.
            default: compute precision of operators no entry matches (ignored for a serialised plan).
            saved: selector -> saved precision, added to the saved entries of ``mapping``.
            saved_default: saved precision of operators no saved entry matches (ignored for a serialised plan).

        Raises:
            PlanError: on an unknown precision, a malformed selector or a malformed serialised plan.
        """
        if not isinstance(mapping, Mapping):
            raise PlanError(f"A plan must be built from a mapping, got {type(mapping).__name__}: {mapping!r}.")
        if is_document(mapping):
            return cls(**document_fields(mapping))
        try:
            default_precision = parse_precision(default)
        except PlanError as err:
            raise PlanError(f"Plan default: {err}") from None
        compute, saved_entries = split_entries(mapping)
        if saved is not None:
            saved_entries.update(as_mapping(saved))
        return cls(entries=parse_entries(compute), default=default_precision, saved=parse_saved(saved_entries),
                   saved_default=saved_default)  # type: ignore[arg-type]  # parsed in __post_init__

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

    def with_entries(self, updates: Mapping[str, Any]) -> PrecisionPlan:
        """A copy of this plan with ``updates`` added or overriding entries of the same selector."""
        merged = dict(self.entries)
        merged.update(parse_entries(updates))
        return replace(self, entries=tuple(merged.items()), provenance=dict(self.provenance))

    def with_saved(self, updates: Mapping[str, Any], default: object | None = None) -> PrecisionPlan:
        """A copy with ``updates`` (selector -> saved precision) added to the saved entries, and ``default`` as
        the saved default if given."""
        merged = dict(self.saved)
        merged.update(parse_saved(updates))
        return replace(self, saved=tuple(merged.items()), provenance=dict(self.provenance),
                       saved_default=self.saved_default if default is None else default)  # type: ignore[arg-type]

    def with_provenance(self, **notes: Any) -> PrecisionPlan:
        """A copy with ``notes`` added to :attr:`provenance`."""
        return replace(self, provenance={**self.provenance, **notes})

    # -------------------------------------------------------------------------------------------------- queries
    @property
    def is_all_fp32(self) -> bool:
        """Whether every operator computes in FP32 under this plan."""
        return self.default is Precision.FP32 and all(p is Precision.FP32 for _, p in self.entries)

    @property
    def compresses_saved(self) -> bool:
        """Whether any operator saves its tensors for backward in a lower precision than computed."""
        return self.saved_default.compresses or any(p.compresses for _, p in self.saved)

    def uses(self, precision: object) -> bool:
        """Whether ``precision`` appears in the plan (as an entry or the default)."""
        wanted = parse_precision(precision)
        return self.default is wanted or any(p is wanted for _, p in self.entries)

    def precision_of(self, name: str, module_type: type | None = None) -> Precision:
        """The precision of the operator called ``name`` (of class ``module_type``, for type selectors)."""
        match = self._match(name, module_type)
        return self.default if match is None else match[1]

    def saved_of(self, name: str, module_type: type | None = None) -> SavedPrecision:
        """The precision in which the operator called ``name`` stores what it saves for backward."""
        selector = self.saved_selectors.match(name, module_type)
        return self.saved_default if selector is None else dict(self.saved)[selector]

    @functools.cached_property
    def selectors(self) -> Selectors:
        """The plan's compute selectors (its entries' keys)."""
        return Selectors(tuple(selector for selector, _ in self.entries))

    @functools.cached_property
    def saved_selectors(self) -> Selectors:
        """The selectors of the plan's saved entries."""
        return Selectors(tuple(selector for selector, _ in self.saved))

    def _match(self, name: str, module_type: type | None) -> tuple[str, Precision] | None:
        selector = self.selectors.match(name, module_type)
        return None if selector is None else (selector, dict(self.entries)[selector])

    def resolve(self, model: nn.Module) -> dict[str, Precision]:
        """The precision of every operator of ``model`` under this plan (shape-only operators included)."""
        return {name: self.precision_of(name, type(module)) for name, module in iter_operators(model)}

    def explain_saved(self, model: nn.Module) -> dict[str, str]:
        """For every operator, the saved entry that decided its saved precision (``"<default>"`` if none)."""
        out = {}
        for name, module in iter_operators(model):
            selector = self.saved_selectors.match(name, type(module))
            out[name] = "<default>" if selector is None else selector
        return out

    def explain(self, model: nn.Module) -> dict[str, str]:
        """For every operator, the selector that decided its precision (``"<default>"`` if none)."""
        out = {}
        for name, module in iter_operators(model):
            match = self._match(name, type(module))
            out[name] = "<default>" if match is None else match[0]
        return out

    def unmatched_entries(self, model: nn.Module) -> list[str]:
        """Selectors of this plan (of either dimension) that match no operator of ``model``."""
        return sorted(set(self.selectors.unmatched(model)) | set(self.saved_selectors.unmatched(model)))

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
        self.selectors.validate(model)
        self.saved_selectors.validate(model, what="saved plan entr")

    def low_operators(self, model: nn.Module) -> list[str]:
        """Names of the operators of ``model`` this plan runs in a 16-bit precision (shape-only ones excluded)."""
        return [
            name
            for name, module in iter_operators(model)
            if self.precision_of(name, type(module)).is_low and classify(module) is not OperatorKind.SHAPE
        ]

    # -------------------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dictionary (plain Python types only) that :meth:`from_dict` turns back into this plan
        (the document of :mod:`lightning_comp.plan.serialised`)."""
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "default": self.default.value,
            "entries": {selector: precision.value for selector, precision in self.entries},
            "saved_default": self.saved_default.value,
            "saved": {selector: saved.value for selector, saved in self.saved},
            "fingerprint": fingerprint_document(self.fingerprint),
            "torch_version": self.torch_version,
            "device_type": self.device_type,
            "device": None if self.device is None else self.device.to_dict(),
            "provenance": plain(dict(self.provenance)),
        }

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
    def summary(self, model: nn.Module | None = None) -> str:
        """A readable table of the plan; with ``model``, one row per operator: its compute precision, the precision of
        what it saves for backward (when the plan sets any), and the selectors that decided them."""
        saved = self.compresses_saved
        if model is None:
            compute, stored = dict(self.entries), dict(self.saved)
            rows: list[tuple[str, ...]] = [
                (s, compute[s].value if s in compute else "-", *((stored[s].value if s in stored else "-",)
                                                                  if saved else ()))
                for s in sorted(set(compute) | set(stored))]
            rows.append(("<default>", self.default.value, *((self.saved_default.value,) if saved else ())))
            return format_table(("selector", "precision", *(("saved",) if saved else ())), rows)
        explain = self.explain(model)
        explain_saved = self.explain_saved(model) if saved else {}
        rows = []
        for name, module in iter_operators(model):
            params = sum(p.numel() for p in module.parameters())
            row = [name or "<root>", type(module).__name__, f"{params:,}", self.precision_of(name, type(module)).value]
            if saved:
                row.append(self.saved_of(name, type(module)).value)
            row.append(explain[name] if not saved or explain_saved[name] == explain[name]
                       else f"{explain[name]} / {explain_saved[name]}")
            rows.append(tuple(row))
        header = ("operator", "type", "params", "precision", *(("saved",) if saved else ()), "decided by")
        tail = f"{sum(1 for r in rows if r[3] != 'fp32')} of {len(rows)} operators in 16-bit precision"
        if saved:
            tail += f", {sum(1 for r in rows if r[4] != 'fp32')} save for backward in bf16/fp8"
        return format_table(header, rows) + "\n" + tail

    def __repr__(self) -> str:
        entries = ", ".join(f"{s!r}: {p.value!r}" for s, p in self.entries)
        saved = ""
        if self.compresses_saved:
            saved = ", saved={" + ", ".join(f"{s!r}: {p.value!r}" for s, p in self.saved) + "}"
            saved += f", saved_default={self.saved_default.value!r}"
        bound = f", fingerprint={self.fingerprint.digest}" if self.fingerprint else ""
        return f"PrecisionPlan({{{entries}}}, default={self.default.value!r}{saved}{bound})"


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

