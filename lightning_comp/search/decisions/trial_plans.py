"""The plan a trial trains with: a group of candidates lowered, plus the cheap operators between two lowered ones.

Cheap operators (norms, activations) that the batch stage found no slower in low precision are *fills*: a run of
them between two candidate operators (a :class:`CheapRun`) is lowered when both ends are, so activations stay low
across the run instead of being cast back and forth.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_comp.errors import SearchConfigError
from lightning_comp.numerics.precision import ComputePrecision, MasterPrecision, SavedPrecision, StatePrecision
from lightning_comp.operators.kinds import OperatorKind, classify
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.decisions.operators import Choice, OperatorDecision

__all__ = ["CheapRun", "cheap_runs", "plan_for"]


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

    def to_dict(self) -> dict[str, Any]:
        """Plain types (checkpoints and the record)."""
        return {"before": self.before, "after": self.after, "operators": list(self.operators)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheapRun:
        """Read :meth:`to_dict`'s form."""
        return cls(str(data["before"]), str(data["after"]), tuple(data["operators"]))


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
             saved: Mapping[str, SavedPrecision] | None = None, state: Mapping[str, StatePrecision] | None = None,
             master: Mapping[str, MasterPrecision] | None = None) -> PrecisionPlan:
    """The plan that lowers ``group``: its compute candidates to ``low`` with the fills of ``runs`` between two of
    them; the operators of its saved candidates saving at ``saved[operator]``; those of its state candidates keeping
    their parameters' optimizer state at ``state[operator]``; and those of its master candidates holding their
    parameters at ``master[operator]``, computing in ``low`` with them (a bf16 master needs a bf16 operator).

    Raises:
        SearchConfigError: if a candidate has no precision of its dimension in the mappings (an inconsistent
            checkpoint).
    """
    if not group:
        return PrecisionPlan()
    by_dimension: dict[Dimension, list[str]] = {dimension: [] for dimension in Dimension}
    for candidate in group:
        by_dimension[candidate.dimension].append(candidate.operator)
    compute = set(by_dimension[Dimension.COMPUTE]) | set(by_dimension[Dimension.MASTER])
    entries = {name: low.value for name in compute}
    for run in runs:
        if run.before in compute and run.after in compute:
            entries.update({name: low.value for name in run.operators})
    chosen: dict[str, dict[str, str]] = {}
    for dimension, mapping, word in ((Dimension.SAVED, saved, "saved"), (Dimension.STATE, state, "optimizer-state"),
                                     (Dimension.MASTER, master, "master-weight")):
        names = by_dimension[dimension]
        missing = [name for name in names if not mapping or name not in mapping]
        if missing:
            raise SearchConfigError(f"{word.capitalize()}-precision candidates {missing} have no {word} precision in"
                                    f" the search state ({dict(mapping or {})!r}); the checkpoint is inconsistent.")
        chosen[dimension.value] = {name: mapping[name].value for name in names} if mapping else {}
    plan = PrecisionPlan.from_dict(entries)
    for dimension in (Dimension.SAVED, Dimension.STATE, Dimension.MASTER):
        plan = plan.with_assignment(dimension, chosen[dimension.value])
    return plan
