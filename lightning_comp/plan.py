"""The precision plan: an immutable assignment of a precision to each operator of a model.

A plan is a set of *entries* ``selector -> precision`` plus a default. Selectors (exact operator names, globs,
``"type:ClassName"``) and their precedence are described in :mod:`lightning_comp.selectors`; any entry beats the
default.

Plans made for a model (:meth:`PrecisionPlan.for_model`, or any plan a search produces) carry the model's operator
fingerprint, the torch version and the class of the device they were made on (:class:`~lightning_comp.DeviceClass`),
so that applying them to another model fails loudly, and applying them on a device where their 16-bit precision is
emulated warns. Files of format version 1 (before device classes were recorded) still load.
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

from lightning_comp.devices import DeviceClass, device_class, model_device
from lightning_comp.dtypes import Precision, parse_precision
from lightning_comp.errors import PlanError, PlanFileError, PlanMismatchError
from lightning_comp.fingerprint import OperatorFingerprint
from lightning_comp.operators import classify, iter_operators
from lightning_comp.selectors import Selectors, check_selector

__all__ = ["OperatorFingerprint", "PrecisionPlan", "PLAN_FORMAT", "PLAN_VERSION"]

PLAN_FORMAT = "lightning-comp/plan"
PLAN_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # 1: before the device class was recorded


def _parse_entries(mapping: Mapping[str, Any]) -> tuple[tuple[str, Precision], ...]:
    if not isinstance(mapping, Mapping):
        raise PlanError(f"Plan entries must be a mapping of selector -> precision, got {type(mapping).__name__}.")
    entries = []
    for selector, value in mapping.items():
        check_selector(selector)
        try:
            precision = parse_precision(value)
        except PlanError as err:
            raise PlanError(f"Plan entry {selector!r}: {err}") from None
        entries.append((selector, precision))
    return tuple(sorted(entries))


@dataclass(frozen=True)
class PrecisionPlan:
    """An immutable assignment of a precision (``fp32``/``bf16``/``fp16``) to each operator of a model.

    Build one with :meth:`from_dict`, :meth:`for_model` or :meth:`load`; never mutate it (use :meth:`with_entries`).

    Attributes:
        entries: ``(selector, precision)`` pairs, sorted by selector.
        default: precision of every operator that no entry matches.
        fingerprint: operators of the model the plan was made for, or ``None`` for a model-independent plan.
        torch_version: torch version the plan was made with, if bound to a model.
        device_type: device type (``"cpu"``, ``"cuda"``) the plan was made for, if bound to a model.
        device: the class of the device the plan was made on (CPU capability, CUDA compute capability, which
            16-bit precisions are native there), if bound to a model; ``None`` for plans of format version 1.
        provenance: free-form JSON-able notes (who made the plan and from what evidence); not part of equality.
    """

    entries: tuple[tuple[str, Precision], ...] = ()
    default: Precision = Precision.FP32
    fingerprint: OperatorFingerprint | None = None
    torch_version: str | None = None
    device_type: str | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    device: DeviceClass | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", _parse_entries(dict(self.entries)))
        try:
            object.__setattr__(self, "default", parse_precision(self.default))
        except PlanError as err:
            raise PlanError(f"Plan default: {err}") from None
        object.__setattr__(self, "provenance", MappingProxyType(dict(self.provenance)))
        for name in ("torch_version", "device_type"):  # plain str: checkpoints must load with weights_only=True
            value = getattr(self, name)
            object.__setattr__(self, name, None if value is None else str.__str__(value))

    def __reduce__(self) -> tuple[Any, ...]:
        # The read-only provenance view cannot be pickled or deep-copied (ddp_spawn pickles the plugin): rebuild.
        return (type(self), (self.entries, self.default, self.fingerprint, self.torch_version, self.device_type,
                             dict(self.provenance), self.device))

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], default: object = "fp32") -> PrecisionPlan:
        """Build a plan from ``{selector: precision}``, or from the dictionary :meth:`to_dict` wrote.

        Args:
            mapping: selector -> precision (see the module docstring for selectors), or a serialised plan.
            default: precision of operators no entry matches (ignored for a serialised plan, which has its own).

        Raises:
            PlanError: on an unknown precision, a malformed selector or a malformed serialised plan.
        """
        if not isinstance(mapping, Mapping):
            raise PlanError(f"A plan must be built from a mapping, got {type(mapping).__name__}: {mapping!r}.")
        if mapping.get("format") == PLAN_FORMAT:
            return cls._from_serialised(mapping)
        try:
            default_precision = parse_precision(default)
        except PlanError as err:
            raise PlanError(f"Plan default: {err}") from None
        return cls(entries=_parse_entries(mapping), default=default_precision)

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
        merged.update(_parse_entries(updates))
        return replace(self, entries=tuple(merged.items()), provenance=dict(self.provenance))

    def with_provenance(self, **notes: Any) -> PrecisionPlan:
        """A copy with ``notes`` added to :attr:`provenance`."""
        return replace(self, provenance={**self.provenance, **notes})

    # -------------------------------------------------------------------------------------------------- queries
    @property
    def is_all_fp32(self) -> bool:
        """Whether every operator computes in FP32 under this plan."""
        return self.default is Precision.FP32 and all(p is Precision.FP32 for _, p in self.entries)

    def uses(self, precision: object) -> bool:
        """Whether ``precision`` appears in the plan (as an entry or the default)."""
        wanted = parse_precision(precision)
        return self.default is wanted or any(p is wanted for _, p in self.entries)

    def precision_of(self, name: str, module_type: type | None = None) -> Precision:
        """The precision of the operator called ``name`` (of class ``module_type``, for type selectors)."""
        match = self._match(name, module_type)
        return self.default if match is None else match[1]

    @functools.cached_property
    def selectors(self) -> Selectors:
        """The plan's selectors (its entries' keys)."""
        return Selectors(tuple(selector for selector, _ in self.entries))

    def _match(self, name: str, module_type: type | None) -> tuple[str, Precision] | None:
        selector = self.selectors.match(name, module_type)
        return None if selector is None else (selector, dict(self.entries)[selector])

    def resolve(self, model: nn.Module) -> dict[str, Precision]:
        """The precision of every operator of ``model`` under this plan (shape-only operators included)."""
        return {name: self.precision_of(name, type(module)) for name, module in iter_operators(model)}

    def explain(self, model: nn.Module) -> dict[str, str]:
        """For every operator, the selector that decided its precision (``"<default>"`` if none)."""
        out = {}
        for name, module in iter_operators(model):
            match = self._match(name, type(module))
            out[name] = "<default>" if match is None else match[0]
        return out

    def unmatched_entries(self, model: nn.Module) -> list[str]:
        """Selectors of this plan that match no operator of ``model``."""
        return self.selectors.unmatched(model)

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

    def low_operators(self, model: nn.Module) -> list[str]:
        """Names of the operators of ``model`` this plan runs in a 16-bit precision (shape-only ones excluded)."""
        return [
            name
            for name, module in iter_operators(model)
            if self.precision_of(name, type(module)).is_low and classify(module).value != "shape"
        ]

    # -------------------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dictionary (plain Python types only) that :meth:`from_dict` turns back into this plan."""
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "default": self.default.value,
            "entries": {selector: precision.value for selector, precision in self.entries},
            "fingerprint": None
            if self.fingerprint is None
            else {"digest": self.fingerprint.digest, "operators": [list(op) for op in self.fingerprint.operators]},
            "torch_version": self.torch_version,
            "device_type": self.device_type,
            "device": None if self.device is None else self.device.to_dict(),
            "provenance": _plain(dict(self.provenance)),
        }

    @classmethod
    def _from_serialised(cls, data: Mapping[str, Any]) -> PrecisionPlan:
        version = data.get("version")
        if version not in _READABLE_VERSIONS:
            raise PlanError(f"Unsupported plan version {version!r}: this lightning-comp reads versions"
                            f" {', '.join(map(str, _READABLE_VERSIONS))}.")
        unknown = set(data) - {"format", "version", "default", "entries", "fingerprint", "torch_version",
                               "device_type", "provenance", *(("device",) if version >= 2 else ())}
        if unknown:
            raise PlanError(f"Unknown keys {sorted(unknown)} in a serialised plan.")
        fingerprint = None
        raw = data.get("fingerprint")
        if raw is not None:
            if not isinstance(raw, Mapping) or not isinstance(raw.get("operators"), list):
                raise PlanError(f"Malformed plan fingerprint {raw!r}: expected {{'operators': [[name, type], ...]}}.")
            try:
                fingerprint = OperatorFingerprint(tuple((str(n), str(t)) for n, t in raw["operators"]))
            except (TypeError, ValueError):
                raise PlanError(f"Malformed plan fingerprint operators {raw['operators']!r}.") from None
            if "digest" in raw and raw["digest"] != fingerprint.digest:
                raise PlanError(
                    f"Plan fingerprint digest {raw['digest']!r} does not match its operator list"
                    f" ({fingerprint.digest}): the file was edited or corrupted."
                )
        provenance = data.get("provenance") or {}
        if not isinstance(provenance, Mapping):
            raise PlanError(f"Plan provenance must be a mapping, got {provenance!r}.")
        for key in ("torch_version", "device_type"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise PlanError(f"Plan {key} must be a string or null, got {data[key]!r}.")
        return cls(
            entries=_parse_entries(data.get("entries") or {}),
            default=parse_precision(data.get("default", "fp32")),
            fingerprint=fingerprint,
            torch_version=data.get("torch_version"),
            device_type=data.get("device_type"),
            provenance=dict(provenance),
            device=None if data.get("device") is None else DeviceClass.from_dict(data["device"]),
        )

    def to_json(self) -> str:
        """The plan as an indented JSON document."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON to ``path`` (parent folders are created) and return the path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(self.to_json() + "\n")
        tmp.replace(target)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrecisionPlan:
        """Read a plan written by :meth:`save` (or a plain ``{selector: precision}`` JSON object).

        Raises:
            PlanFileError: if the file is missing, unreadable, not JSON, or JSON of the wrong shape.
        """
        target = Path(path)
        try:
            text = target.read_text()
        except FileNotFoundError:
            raise PlanFileError(f"Plan file {str(target)!r} does not exist.") from None
        except (OSError, UnicodeDecodeError) as err:
            raise PlanFileError(f"Plan file {str(target)!r} cannot be read: {err}.") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanFileError(f"Plan file {str(target)!r} is not valid JSON: {err}.") from None
        if not isinstance(data, dict):
            raise PlanFileError(
                f"Plan file {str(target)!r} holds a JSON {type(data).__name__}; expected an object, either a saved"
                " plan or {selector: precision}."
            )
        try:
            return cls.from_dict(data)
        except PlanError as err:
            raise PlanFileError(f"Plan file {str(target)!r}: {err}") from None

    # ------------------------------------------------------------------------------------------------- display
    def summary(self, model: nn.Module | None = None) -> str:
        """A readable table of the plan; with ``model``, one row per operator with its precision and why."""
        if model is None:
            rows = [(sel, p.value) for sel, p in self.entries] + [("<default>", self.default.value)]
            width = max(len(r[0]) for r in rows)
            return "\n".join([f"{'selector':<{width}}  precision", "-" * (width + 11)] +
                             [f"{s:<{width}}  {p}" for s, p in rows])
        explain = self.explain(model)
        rows2 = []
        for name, module in iter_operators(model):
            params = sum(p.numel() for p in module.parameters())
            precision = self.precision_of(name, type(module)).value
            rows2.append((name or "<root>", type(module).__name__, f"{params:,}", precision, explain[name]))
        header = ("operator", "type", "params", "precision", "decided by")
        widths = [max(len(str(r[i])) for r in [header, *rows2]) for i in range(5)]
        lines = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
        lines += ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) for r in rows2]
        low = sum(1 for r in rows2 if r[3] != "fp32")
        lines.append(f"{low} of {len(rows2)} operators in 16-bit precision")
        return "\n".join(lines)

    def __repr__(self) -> str:
        entries = ", ".join(f"{s!r}: {p.value!r}" for s, p in self.entries)
        bound = f", fingerprint={self.fingerprint.digest}" if self.fingerprint else ""
        return f"PrecisionPlan({{{entries}}}, default={self.default.value!r}{bound})"


def _plain(value: Any) -> Any:
    """Convert ``value`` to plain JSON types (dicts with str keys, lists, str, int, float, bool, None)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, Precision):
        return value.value
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def plan_from_any(plan: PrecisionPlan | Mapping[str, Any] | str | os.PathLike[str] | None) -> PrecisionPlan:
    """Accept a plan, a ``{selector: precision}`` mapping, a path to a saved plan, or ``None`` (all FP32)."""
    if plan is None:
        return PrecisionPlan()
    if isinstance(plan, PrecisionPlan):
        return plan
    if isinstance(plan, Mapping):
        return PrecisionPlan.from_dict(_plain(plan))
    if isinstance(plan, (str, os.PathLike)):
        return PrecisionPlan.load(plan)
    raise PlanError(
        f"Cannot make a plan from {type(plan).__name__} {plan!r}: pass a PrecisionPlan, a mapping"
        " {selector: precision}, a path to a saved plan, or None."
    )

