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
from lightning_comp.numerics.precision import (
    ComputePrecision,
    MasterPrecision,
    SavedPrecision,
    StatePrecision,
    parse_precision,
    parse_saved_precision,
)
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.operators.kinds import OperatorKind, classify
from lightning_comp.plan.entries import as_mapping, parse_entries, parse_master, parse_saved, parse_state, split_entries
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

    Four independent dimensions per operator: the precision it computes in (``fp32``/``bf16``/``fp16``); the
    precision in which the tensors it saves for backward are stored (``fp32`` as computed, ``bf16``, ``fp8``, or
    ``recompute``: not stored, recomputed in backward; see :class:`~lightning_comp.numerics.precision.SavedPrecision`);
    and, for the parameters it owns (:func:`~lightning_comp.execution.parameter_groups.parameter_owners`), the
    precision of their optimizer state (``fp32``/``bf16``/``8bit``) and of their master copy (``fp32``/``bf16``).
    Build one with :meth:`from_dict`, :meth:`for_model` or :meth:`load`; never mutate it (use :meth:`with_entries`,
    :meth:`with_saved`, :meth:`with_state` and :meth:`with_master`).

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
        state: ``(selector, optimizer-state precision)`` pairs, sorted by selector.
        state_default: optimizer-state precision of the parameters of every operator no ``state`` entry matches.
        master: ``(selector, master-weight precision)`` pairs, sorted by selector.
        master_default: master-weight precision of the parameters of every operator no ``master`` entry matches.
    """

    entries: tuple[tuple[str, ComputePrecision], ...] = ()
    default: ComputePrecision = ComputePrecision.FP32
    fingerprint: OperatorFingerprint | None = None
    torch_version: str | None = None
    device_type: str | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    device: DeviceClass | None = field(default=None, compare=False, hash=False)
    saved: tuple[tuple[str, SavedPrecision], ...] = ()
    saved_default: SavedPrecision = SavedPrecision.FP32
    state: tuple[tuple[str, StatePrecision], ...] = ()
    state_default: StatePrecision = StatePrecision.FP32
    master: tuple[tuple[str, MasterPrecision], ...] = ()
    master_default: MasterPrecision = MasterPrecision.FP32

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", parse_entries(as_mapping(self.entries)))
        object.__setattr__(self, "saved", parse_saved(as_mapping(self.saved)))
        object.__setattr__(self, "state", parse_state(as_mapping(self.state)))
        object.__setattr__(self, "master", parse_master(as_mapping(self.master)))
        try:
            object.__setattr__(self, "default", parse_precision(self.default))
        except PlanError as err:
            raise PlanError(f"Plan default: {err}") from None
        try:
            object.__setattr__(self, "saved_default", parse_saved_precision(self.saved_default))
        except PlanError as err:
            raise PlanError(f"Plan saved_default: {err}") from None
        for name, parse in (("state_default", StatePrecision.parse), ("master_default", MasterPrecision.parse)):
            try:
                object.__setattr__(self, name, parse(getattr(self, name)))
            except PlanError as err:
                raise PlanError(f"Plan {name}: {err}") from None
        object.__setattr__(self, "provenance", MappingProxyType(dict(self.provenance)))
        for name in ("torch_version", "device_type"):  # plain str: checkpoints must load with weights_only=True
            value = getattr(self, name)
            object.__setattr__(self, name, None if value is None else str.__str__(value))

    def __reduce__(self) -> tuple[Any, ...]:
        # The read-only provenance view cannot be pickled or deep-copied (ddp_spawn pickles the plugin): rebuild.
        return (type(self), (self.entries, self.default, self.fingerprint, self.torch_version, self.device_type,
                             dict(self.provenance), self.device, self.saved, self.saved_default, self.state,
                             self.state_default, self.master, self.master_default))

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], default: object = "fp32", *,
                  saved: Mapping[str, Any] | None = None, saved_default: object = "fp32",
                  state: Mapping[str, Any] | None = None, state_default: object = "fp32",
                  master: Mapping[str, Any] | None = None, master_default: object = "fp32") -> PrecisionPlan:
        """Build a plan from ``{selector: precision}``, or from the dictionary :meth:`to_dict` wrote.

        An entry's value is a compute precision (``"bf16"``), or a mapping that sets any of the dimensions
        (``{"compute": "bf16", "saved": "fp8", "state": "8bit", "master": "bf16"}``, or ``{"saved": "recompute"}``).

        Args:
            mapping: selector -> precision (see the module docstring for selectors), or a serialised plan.
            default: compute precision of operators no entry matches (ignored for a serialised plan).
            saved: selector -> saved precision, added to the saved entries of ``mapping``.
            saved_default: saved precision of operators no saved entry matches (ignored for a serialised plan).
            state: selector -> optimizer-state precision, added to the state entries of ``mapping``.
            state_default: optimizer-state precision of operators no state entry matches.
            master: selector -> master-weight precision, added to the master entries of ``mapping``.
            master_default: master-weight precision of operators no master entry matches.

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
        split = split_entries(mapping)
        for dimension, extra in (("saved", saved), ("state", state), ("master", master)):
            if extra is not None:
                split[dimension].update(as_mapping(extra))
        return cls(entries=parse_entries(split["compute"]), default=default_precision,  # defaults parsed in post-init
                   saved=parse_saved(split["saved"]), saved_default=saved_default,  # type: ignore[arg-type]
                   state=parse_state(split["state"]), state_default=state_default,  # type: ignore[arg-type]
                   master=parse_master(split["master"]), master_default=master_default)  # type: ignore[arg-type]

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

    def with_state(self, updates: Mapping[str, Any], default: object | None = None) -> PrecisionPlan:
        """A copy with ``updates`` (selector -> optimizer-state precision) added to the state entries, and
        ``default`` as the state default if given."""
        merged = dict(self.state)
        merged.update(parse_state(updates))
        return replace(self, state=tuple(merged.items()), provenance=dict(self.provenance),
                       state_default=self.state_default if default is None else default)  # type: ignore[arg-type]

    def with_master(self, updates: Mapping[str, Any], default: object | None = None) -> PrecisionPlan:
        """A copy with ``updates`` (selector -> master-weight precision) added to the master entries, and
        ``default`` as the master default if given."""
        merged = dict(self.master)
        merged.update(parse_master(updates))
        return replace(self, master=tuple(merged.items()), provenance=dict(self.provenance),
                       master_default=self.master_default if default is None else default)  # type: ignore[arg-type]

    def with_provenance(self, **notes: Any) -> PrecisionPlan:
        """A copy with ``notes`` added to :attr:`provenance`."""
        return replace(self, provenance={**self.provenance, **notes})

    # -------------------------------------------------------------------------------------------------- queries
    @property
    def is_all_fp32(self) -> bool:
        """Whether every operator computes in FP32 under this plan."""
        return self.default is ComputePrecision.FP32 and all(p is ComputePrecision.FP32 for _, p in self.entries)

    @property
    def compresses_saved(self) -> bool:
        """Whether any operator saves its tensors for backward in a lower precision than computed."""
        return self.saved_default.compresses or any(p.compresses for _, p in self.saved)

    @property
    def changes_saved(self) -> bool:
        """Whether any operator saves for backward other than as computed (compressed, or recomputed)."""
        return self.saved_default.changes or any(p.changes for _, p in self.saved)

    @property
    def recomputes(self) -> bool:
        """Whether any operator's output is recomputed in backward instead of stored."""
        return self.saved_default.recomputes or any(p.recomputes for _, p in self.saved)

    @property
    def manages_parameters(self) -> bool:
        """Whether any operator's parameters keep their optimizer state or master copy other than in FP32."""
        return (self.state_default.managed or self.master_default.managed
                or any(p.managed for _, p in self.state) or any(p.managed for _, p in self.master))

    def uses(self, precision: object) -> bool:
        """Whether ``precision`` appears in the plan (as an entry or the default)."""
        wanted = parse_precision(precision)
        return self.default is wanted or any(p is wanted for _, p in self.entries)

    def precision_of(self, name: str, module_type: type | None = None) -> ComputePrecision:
        """The precision of the operator called ``name`` (of class ``module_type``, for type selectors)."""
        match = self._match(name, module_type)
        return self.default if match is None else match[1]

    def saved_of(self, name: str, module_type: type | None = None) -> SavedPrecision:
        """The precision in which the operator called ``name`` stores what it saves for backward."""
        selector = self.saved_selectors.match(name, module_type)
        return self.saved_default if selector is None else dict(self.saved)[selector]

    def state_of(self, name: str, module_type: type | None = None) -> StatePrecision:
        """The optimizer-state precision of the parameters the operator called ``name`` owns."""
        selector = self.state_selectors.match(name, module_type)
        return self.state_default if selector is None else dict(self.state)[selector]

    def master_of(self, name: str, module_type: type | None = None) -> MasterPrecision:
        """The master-weight precision of the parameters the operator called ``name`` owns."""
        selector = self.master_selectors.match(name, module_type)
        return self.master_default if selector is None else dict(self.master)[selector]

    @functools.cached_property
    def state_selectors(self) -> Selectors:
        """The selectors of the plan's optimizer-state entries."""
        return Selectors(tuple(selector for selector, _ in self.state))

    @functools.cached_property
    def master_selectors(self) -> Selectors:
        """The selectors of the plan's master-weight entries."""
        return Selectors(tuple(selector for selector, _ in self.master))

    @functools.cached_property
    def selectors(self) -> Selectors:
        """The plan's compute selectors (its entries' keys)."""
        return Selectors(tuple(selector for selector, _ in self.entries))

    @functools.cached_property
    def saved_selectors(self) -> Selectors:
        """The selectors of the plan's saved entries."""
        return Selectors(tuple(selector for selector, _ in self.saved))

    def _match(self, name: str, module_type: type | None) -> tuple[str, ComputePrecision] | None:
        selector = self.selectors.match(name, module_type)
        return None if selector is None else (selector, dict(self.entries)[selector])

    def resolve(self, model: nn.Module) -> dict[str, ComputePrecision]:
        """The precision of every operator of ``model`` under this plan (shape-only operators included)."""
        return {name: self.precision_of(name, type(module)) for name, module in iter_operators(model)}

    def explain_saved(self, model: nn.Module) -> dict[str, str]:
        """For every operator, the saved entry that decided its saved precision (``"<default>"`` if none)."""
        return self._explain(model, self.saved_selectors)

    @staticmethod
    def _explain(model: nn.Module, selectors: Selectors) -> dict[str, str]:
        out = {}
        for name, module in iter_operators(model):
            selector = selectors.match(name, type(module))
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
        return sorted(set(self.selectors.unmatched(model)) | set(self.saved_selectors.unmatched(model))
                      | set(self.state_selectors.unmatched(model)) | set(self.master_selectors.unmatched(model)))

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
        self.state_selectors.validate(model, what="optimizer-state plan entr")
        self.master_selectors.validate(model, what="master-weight plan entr")

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
            "state_default": self.state_default.value,
            "state": {selector: state.value for selector, state in self.state},
            "master_default": self.master_default.value,
            "master": {selector: master.value for selector, master in self.master},
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
    def _shown_dimensions(self) -> list[tuple[str, tuple[tuple[str, Any], ...], Any, Any]]:
        """The dimensions beside compute the plan sets anything in: ``(column, entries, default, of-function)``."""
        shown: list[tuple[str, tuple[tuple[str, Any], ...], Any, Any]] = []
        if self.changes_saved:
            shown.append(("saved", self.saved, self.saved_default, self.saved_of))
        if self.state_default.managed or any(p.managed for _, p in self.state):
            shown.append(("state", self.state, self.state_default, self.state_of))
        if self.master_default.managed or any(p.managed for _, p in self.master):
            shown.append(("master", self.master, self.master_default, self.master_of))
        return shown

    def summary(self, model: nn.Module | None = None) -> str:
        """A readable table of the plan; with ``model``, one row per operator: its compute precision, the precision of
        what it saves for backward, of its parameters' optimizer state and master copy (each when the plan sets any),
        and the selectors that decided its compute precision."""
        shown = self._shown_dimensions()
        columns = tuple(column for column, *_ in shown)
        if model is None:
            compute = dict(self.entries)
            others = [dict(entries) for _, entries, _, _ in shown]
            selectors = sorted(set(compute).union(*others))
            rows: list[tuple[str, ...]] = [
                (s, compute[s].value if s in compute else "-", *(o[s].value if s in o else "-" for o in others))
                for s in selectors]
            rows.append(("<default>", self.default.value, *(default.value for _, _, default, _ in shown)))
            return format_table(("selector", "precision", *columns), rows)
        explains = [self.explain(model)] + [self._explain(model, selectors) for selectors in (
            {"saved": self.saved_selectors, "state": self.state_selectors, "master": self.master_selectors}[column]
            for column in columns)]
        rows = []
        for name, module in iter_operators(model):
            params = sum(p.numel() for p in module.parameters())
            kind = type(module)
            deciders = list(dict.fromkeys(explain[name] for explain in explains))  # distinct, in column order
            rows.append((name or "<root>", kind.__name__, f"{params:,}", self.precision_of(name, kind).value,
                         *(of(name, kind).value for _, _, _, of in shown), " / ".join(deciders)))
        header = ("operator", "type", "params", "precision", *columns, "decided by")
        tail = f"{sum(1 for r in rows if r[3] != 'fp32')} of {len(rows)} operators in 16-bit precision"
        words = {"saved": "save for backward in bf16/fp8 or recompute", "state": "keep optimizer state in bf16/8bit",
                 "master": "keep bf16 master weights"}
        for offset, column in enumerate(columns):
            tail += f", {sum(1 for r in rows if r[4 + offset] != 'fp32')} {words[column]}"
        return format_table(header, rows) + "\n" + tail

    def __repr__(self) -> str:
        entries = ", ".join(f"{s!r}: {p.value!r}" for s, p in self.entries)
        others = ""
        for column, pairs, default, _ in self._shown_dimensions():
            others += f", {column}={{" + ", ".join(f"{s!r}: {p.value!r}" for s, p in pairs) + "}"
            others += f", {column}_default={default.value!r}"
        bound = f", fingerprint={self.fingerprint.digest}" if self.fingerprint else ""
        return f"PrecisionPlan({{{entries}}}, default={self.default.value!r}{others}{bound})"


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

