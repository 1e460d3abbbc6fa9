"""The plan a trial trains with: a group of candidates lowered, plus the cheap operators between two lowered ones.

Cheap operators (norms, activations) that the batch stage found no slower in low precision are *fills*: a run of
them between two candidate operators (a :class:`CheapRun`) is lowered when both ends are, so activations stay low
across the run instead of being cast back and forth.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from torch import nn

from lightning_comp.errors import SearchConfigError
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.kinds import OperatorKind, classify
from lightning_comp.plan.dimensions import Dimension, DimensionValue
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.decisions.groups import OperatorGroup
from lightning_comp.search.decisions.operators import Choice, OperatorDecision

__all__ = ["PARAMETER_SIDE", "CheapRun", "Choices", "PlanRole", "cheap_runs", "compute_candidates", "plan_for"]

PARAMETER_SIDE = (Dimension.SAVED, Dimension.STATE, Dimension.MASTER)  # the dimensions whose candidates carry a value
# per dimension of PARAMETER_SIDE, operator -> its value; COMPUTE: operator -> the fp8 precision of its fp8 candidate
Choices = dict[Dimension, dict[str, DimensionValue]]


class PlanRole(str, Enum):
    """What a plan the search puts in force is to it: noted once, as ``provenance["role"]``, by :meth:`mark`.

    The plugin is told only that the search tries the plan on purpose (``CoMPPrecision.try_plan``); what the plan is
    to the search travels with the plan (saved with it, shown in the record).
    """

    TRIAL = "trial"  # a convergence trial's plan (the FP32 reference's too), or one the batch stage measures
    CHOSEN = "chosen"  # the plan the search chose

    def mark(self, plan: PrecisionPlan, **notes: Any) -> PrecisionPlan:
        """``plan`` with this role (and ``notes``) in its provenance."""
        return plan.with_provenance(role=self.value, **notes)


@dataclass(frozen=True)
class CheapRun:
    """Fill operators between two candidate operators, lowered when both are.

    Attributes:
        before: the candidate before the run.
        after: the candidate after it.
        operators: the fills, in execution order.
    """

    before: str
    after: str
    operators: tuple[str, ...]


def cheap_runs(order: Sequence[str], decisions: Mapping[str, OperatorDecision],
               modules: Mapping[str, nn.Module]) -> list[CheapRun]:
    """Maximal runs of fill operators between two candidate operators, in execution order (shape-only operators
    in between neither break nor join a run)."""
    runs = []
    before: str | None = None
    pending: list[str] = []
    for name in order:
        decision = decisions[name].decision if name in decisions else None
        if decision is Choice.CANDIDATE:
            if before is not None and pending:
                runs.append(CheapRun(before, name, tuple(pending)))
            before, pending = name, []
        elif decision is Choice.FILL:
            pending.append(name)
        elif classify(modules[name]) is OperatorKind.SHAPE:
            continue
        else:
            before, pending = None, []
    return runs


def plan_for(low: ComputePrecision, runs: Iterable[CheapRun], group: Sequence[Candidate] | None,
             choices: Mapping[Dimension, Mapping[str, DimensionValue]] | None = None) -> PrecisionPlan:
    """The plan that lowers ``group``: its compute candidates to ``low`` with the fills of ``runs`` between two of
    them; its fp8 candidates to their fp8 precision, ``choices[COMPUTE][operator]`` (computing low: a run of fills
    next to one is lowered as next to a compute candidate); and the operators of its candidates of the other
    dimensions at ``choices[dimension][operator]`` (its saved candidates saving at that saved precision, its state
    candidates keeping their optimizer state at that precision, its master candidates holding their parameters at
    that precision and computing in ``low`` with them, as the master was measured, except where
    ``choices[COMPUTE][operator]`` is fp32: that master was measured on an operator computing in FP32, with FP32
    copies of its bf16 parameters, and it stays FP32).

    Raises:
        SearchConfigError: if a candidate has no value of its dimension in ``choices`` (an inconsistent checkpoint).
    """
    if not group:
        return PrecisionPlan()
    by_dimension: dict[Dimension, list[str]] = {dimension: [] for dimension in Dimension}
    fp8 = [candidate.operator for candidate in group if candidate.fp8]
    for candidate in group:
        if not candidate.fp8:
            by_dimension[candidate.dimension].append(candidate.operator)
    computes = (choices or {}).get(Dimension.COMPUTE) or {}
    masters_low = {name for name in by_dimension[Dimension.MASTER] if computes.get(name) is not ComputePrecision.FP32}
    compute = set(by_dimension[Dimension.COMPUTE]) | masters_low | set(fp8)
    entries = {name: low.value for name in compute}
    for run in runs:
        if run.before in compute and run.after in compute:
            entries.update({name: low.value for name in run.operators})
    precisions = (choices or {}).get(Dimension.COMPUTE) or {}
    missing = [name for name in fp8 if name not in precisions]
    if missing:
        raise SearchConfigError(f"fp8 candidates {missing} have no fp8 precision in the search state"
                                f" ({dict(precisions)!r}); the checkpoint is inconsistent.")
    entries.update({name: precisions[name].value for name in fp8})
    plan = PrecisionPlan.from_dict(entries)
    for dimension in PARAMETER_SIDE:
        names = by_dimension[dimension]
        mapping = (choices or {}).get(dimension) or {}
        missing = [name for name in names if name not in mapping]
        if missing:
            raise SearchConfigError(f"{dimension.what.capitalize()} candidates {missing} have no {dimension.what} in"
                                    f" the search state ({dict(mapping)!r}); the checkpoint is inconsistent.")
        plan = plan.with_assignment(dimension, {name: mapping[name].value for name in names})
    return plan


def compute_candidates(lowered: Sequence[str], groups: Iterable[OperatorGroup]) -> list[Candidate]:
    """The compute candidates of a plan lowering exactly ``lowered`` (in execution order): one per group whose
    members it all lowers and whose glob names exactly them (the plan writes that glob), one per operator otherwise."""
    chosen = set(lowered)
    by_member = {member: group for group in groups for member in group.members}
    out: list[Candidate] = []
    seen: set[str] = set()
    for name in lowered:
        group = by_member.get(name)
        if group is not None and group.exact_glob and chosen.issuperset(group.members):
            if group.pattern not in seen:
                seen.add(group.pattern)
                out.append(Candidate(group.pattern))
        else:
            out.append(Candidate(name))
    return out
