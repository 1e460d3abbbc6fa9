"""What the batch stage hands to the epoch stage, and what the decision record keeps of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_comp.numerics.precision import MasterPrecision, SavedPrecision, StatePrecision
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.parameters import ParameterStepCheck
from lightning_comp.search.decisions.saved import SavedStepCheck
from lightning_comp.search.decisions.trial_plans import CheapRun

__all__ = ["BatchStageResult", "ParameterStageResult", "SavedStageResult"]


@dataclass
class SavedStageResult:
    """The saved-precision candidates the saved stage found.

    Attributes:
        choices: operator -> the saved precision of its saved candidate.
        benefits: per saved candidate, what it gains in the objective's unit.
        check: the whole-step check of the candidate plan with and without them (``None``: not made).
    """

    choices: dict[str, SavedPrecision] = field(default_factory=dict)
    benefits: dict[Candidate, float] = field(default_factory=dict)
    check: SavedStepCheck | None = None

    def drop(self, operator: str) -> None:
        """Take ``operator``'s saved candidate out (it saves as computed after all)."""
        del self.choices[operator]
        self.benefits.pop(Candidate.saved(operator))


@dataclass
class ParameterStageResult:
    """The optimizer-state and master-weight candidates the parameter stage found.

    Attributes:
        state_choices: operator -> the optimizer-state precision of its state candidate.
        master_choices: operator -> the master-weight precision of its master candidate.
        benefits: per candidate, what it gains in the objective's unit.
        gains: operator -> the bytes its choices save.
        check: the whole-step check of the plan with and without them (``None``: not made).
        skipped: why the stage did not run (``None``: it ran).
    """

    state_choices: dict[str, StatePrecision] = field(default_factory=dict)
    master_choices: dict[str, MasterPrecision] = field(default_factory=dict)
    benefits: dict[Candidate, float] = field(default_factory=dict)
    gains: dict[str, int] = field(default_factory=dict)
    check: ParameterStepCheck | None = None
    skipped: str | None = None

    def drop(self, operator: str) -> None:
        """Take ``operator``'s state and master candidates out (the whole step found against them)."""
        self.state_choices.pop(operator, None)
        self.master_choices.pop(operator, None)
        self.benefits.pop(Candidate.state(operator), None)
        self.benefits.pop(Candidate.master(operator), None)
        self.gains.pop(operator, None)

    def to_dict(self) -> dict[str, Any]:
        """The record's form."""
        out: dict[str, Any] = {"state": {n: s.value for n, s in self.state_choices.items()},
                               "master": {n: m.value for n, m in self.master_choices.items()}}
        if self.check is not None:
            out["check"] = self.check.to_dict()
        if self.skipped is not None:
            out["skipped"] = self.skipped
        return out


@dataclass
class BatchStageResult:
    """The batch stage's measurements and decisions (rank 0's, on every rank).

    Attributes:
        decisions: per operator, its measurements and decision.
        candidates: what the epoch stage trials, in execution order (saved candidates after their operators).
        benefits: per candidate, what it gains in the objective's unit (ranks the fallback groups).
        runs: the runs of cheap operators lowered between two lowered candidates.
        saved: the saved-precision candidates (memory and balanced objectives).
        parameters: the optimizer-state and master-weight candidates (memory and balanced objectives).
        order: the operators in the order they first ran.
        step_ms: whole-step time per plan timed (fastest round, the clock's milliseconds).
        step_wall_ms: the same steps' real time.
        step_ratios: each plan's step time relative to FP32, with its interval.
        step_saved_bytes: bytes each plan saves for backward in a step (objectives that weigh memory).
        memory: per profiled configuration, bytes saved for backward and (CUDA) the step's peak.
        timing: the clock it measured with, and why.
    """

    decisions: dict[str, OperatorDecision]
    candidates: tuple[Candidate, ...]
    benefits: dict[Candidate, float]
    runs: list[CheapRun]
    saved: SavedStageResult
    order: list[str]
    step_ms: dict[str, float]
    step_wall_ms: dict[str, float]
    step_ratios: dict[str, dict[str, float | int]]
    step_saved_bytes: dict[str, float]
    memory: dict[str, dict[str, int | None]]
    timing: dict[str, Any] | None = None
    parameters: ParameterStageResult = field(default_factory=ParameterStageResult)

    def profile(self) -> dict[str, Any]:
        """The decision record's form of the measurements (``operators``, ``step_ms``, ... ``saved_step``)."""
        return {
            "operators": {name: decision.to_dict() for name, decision in self.decisions.items()},
            "step_ms": dict(self.step_ms),
            "step_wall_ms": dict(self.step_wall_ms),
            "step_ratios": dict(self.step_ratios),
            "step_saved_bytes": dict(self.step_saved_bytes),
            "order": list(self.order),
            "memory": dict(self.memory),
            "timing": self.timing,
            "saved_step": {} if self.saved.check is None else self.saved.check.to_dict(),
            "parameter_step": self.parameters.to_dict(),
        }
