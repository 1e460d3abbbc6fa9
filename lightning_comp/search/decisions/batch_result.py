"""What the batch stage decided and measured: handed to the epoch stage, kept in the search state, recorded.

The result is typed while the search runs; :mod:`lightning_comp.search.state` writes it into a checkpoint in plain
types and reads it back, and :mod:`lightning_comp.search.record.build` turns it into the decision record's form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_comp.numerics.precision import ComputePrecision, MasterPrecision, SavedPrecision, StatePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.decisions.cheapest_bytes import MemorySpending
from lightning_comp.search.decisions.groups import OperatorGroup
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.refinement import GroupFlip
from lightning_comp.search.decisions.trial_plans import CheapRun, Choices
from lightning_comp.search.decisions.whole_step import ComparedPlan, PlanStep, ProfiledPlan, TrialledPlan

__all__ = ["BatchStageResult", "Fp8StageResult", "ParameterStageResult", "SavedStageResult", "StepMemory"]


@dataclass
class Fp8StageResult:
    """The fp8 candidates the fp8 stage found (:mod:`lightning_comp.search.stages.fp8_stage`).

    Attributes:
        precision: the fp8 precision searched (its recipe), ``None``: fp8 not searched.
        choices: operator (or a group's glob) -> the fp8 precision of its fp8 candidate.
        benefits: per fp8 candidate, the milliseconds per step it saves against its 16-bit lowering.
        skipped: why the stage did not run, or why it took nothing (``None``: it ran and decided per operator).
    """

    precision: ComputePrecision | None = None
    choices: dict[str, ComputePrecision] = field(default_factory=dict)
    benefits: dict[Candidate, float] = field(default_factory=dict)
    skipped: str | None = None


@dataclass
class SavedStageResult:
    """The saved-precision candidates the saved stage found.

    Attributes:
        choices: operator -> the saved precision of its saved candidate.
        benefits: per saved candidate, what it gains in the objective's unit.
    """

    choices: dict[str, SavedPrecision] = field(default_factory=dict)
    benefits: dict[Candidate, float] = field(default_factory=dict)

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
        skipped: why the stage did not run (``None``: it ran).
    """

    state_choices: dict[str, StatePrecision] = field(default_factory=dict)
    master_choices: dict[str, MasterPrecision] = field(default_factory=dict)
    benefits: dict[Candidate, float] = field(default_factory=dict)
    gains: dict[str, int] = field(default_factory=dict)
    skipped: str | None = None

    def drop(self, operator: str) -> None:
        """Take ``operator``'s state and master candidates out (not taken after all)."""
        self.state_choices.pop(operator, None)
        self.master_choices.pop(operator, None)
        self.benefits.pop(Candidate.state(operator), None)
        self.benefits.pop(Candidate.master(operator), None)
        self.gains.pop(operator, None)


@dataclass(frozen=True)
class StepMemory:
    """What one profiled step held.

    Attributes:
        saved_bytes: bytes saved for backward.
        peak_bytes: the step's peak (CUDA only; ``None`` elsewhere).
        reserved_bytes: the CUDA allocator's reserved peak of one step (``None`` off CUDA or not measured).
        live_bytes: the bytes live at the step's high point, measured on the process (``None``: not measured).
        os_bytes: the OS-level peak of the process over the step (``None``: not measured).
        how: how the process peaks were measured, or why one is missing (empty: not measured).
    """

    saved_bytes: int
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    live_bytes: int | None = None
    os_bytes: int | None = None
    how: str = ""


@dataclass
class BatchStageResult:
    """The batch stage's measurements and decisions (rank 0's, on every rank).

    Attributes:
        decisions: per operator, its measurements and decision.
        candidates: what the epoch stage trials, in execution order (saved candidates after their operators).
        benefits: per candidate, what it gains in the objective's unit (ranks the fallback groups).
        runs: the runs of cheap operators lowered between two lowered candidates.
        saved: the saved-precision candidates (memory and balanced objectives).
        order: the operators in the order they first ran.
        steps: per plan timed as a whole step, its timing.
        memory: per profiled plan, what its step held.
        timing: the clock it measured with, and why (the record's form).
        parameters: the optimizer-state and master-weight candidates (memory and balanced objectives).
        groups: the groups of several operators decided as one (operators playing the same part in repeated
            blocks).
        flips: the refinement's flips, in the order tried (throughput objective).
        trialled: the plan handed to the epoch stage and the batch stage's forecast of its step (``None``: not
            decided).
        memory_spending: (memory objective) the memory levers ranked by bytes per millisecond, what was taken and
            the frontier (``None``: not run).
        fp8: the fp8 candidates (where fp8 is searched).
    """

    decisions: dict[str, OperatorDecision]
    candidates: tuple[Candidate, ...]
    benefits: dict[Candidate, float]
    runs: list[CheapRun]
    saved: SavedStageResult
    order: list[str]
    steps: dict[ComparedPlan, PlanStep]
    memory: dict[ProfiledPlan, StepMemory]
    timing: dict[str, Any] | None = None
    parameters: ParameterStageResult = field(default_factory=ParameterStageResult)
    groups: list[OperatorGroup] = field(default_factory=list)
    flips: list[GroupFlip] = field(default_factory=list)
    trialled: TrialledPlan | None = None
    memory_spending: MemorySpending | None = None
    fp8: Fp8StageResult = field(default_factory=Fp8StageResult)

    @property
    def members(self) -> dict[Candidate, tuple[Candidate, ...]]:
        """Per compute candidate naming a group of operators (its glob), its members' candidates."""
        out: dict[Candidate, tuple[Candidate, ...]] = {}
        for fp8 in (False, True):  # a group's fp8 candidate splits into its members' fp8 candidates
            named = {c.operator for c in self.candidates if c.dimension is Dimension.COMPUTE and c.fp8 is fp8}
            out.update({Candidate(group.pattern, fp8=fp8): tuple(Candidate(m, fp8=fp8) for m in group.members)
                        for group in self.groups if group.exact_glob and group.pattern in named})
        return out

    @property
    def choices(self) -> Choices:
        """Per parameter-side dimension, operator -> the value of its candidate of that dimension; and for compute,
        operator -> the fp8 precision of its fp8 candidate (a group's glob: each member's too, for its split), and
        fp32 for an operator whose master candidate leaves it computing in FP32."""
        fp8: dict[str, ComputePrecision] = dict(self.fp8.choices)
        for group in self.groups:
            if group.pattern in fp8:
                fp8.update(dict.fromkeys(group.members, fp8[group.pattern]))
        for name in self.parameters.master_choices:  # (ParameterDecision.master_computes_fp32)
            parameters = self.decisions[name].parameters if name in self.decisions else None
            if parameters is not None and parameters.master_computes_fp32:
                fp8[name] = ComputePrecision.FP32
        return {Dimension.COMPUTE: fp8, Dimension.SAVED: dict(self.saved.choices),  # type: ignore[dict-item]
                Dimension.STATE: dict(self.parameters.state_choices),
                Dimension.MASTER: dict(self.parameters.master_choices)}
