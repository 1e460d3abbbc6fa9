"""Each operator's optimizer-state and master-weight precision (memory and balanced objectives).

What an operator's parameters hold between steps is judged against the whole step, since it is part of the step's
peak whatever the step does: the weights, their gradients and the optimizer state, plus what the step saves for
backward (:class:`StepBudget`). Bytes follow from the formats (exact); time is the measured update of that operator's
parameters in each format against the optimizer's own (:mod:`lightning_comp.search.measurement.optimizer_timing`),
taken at the slow end of its interval.

=============  ==========================================================================================
objective      an optimizer-state or master-weight lowering of one operator pays when
=============  ==========================================================================================
memory         it saves the margin's share of its own bytes, and the step, slowed by it, stays within
               ``max_slowdown_vs_fastest`` of the pace's (the fastest fixed policy measured)
balanced       it improves the step's time x memory: ``(1 + extra time / step time) x (1 - bytes saved / step
               bytes) < 1``, and the step, slowed by it, stays within ``max_slowdown_vs_fastest`` of the pace's
=============  ==========================================================================================

Of the state formats that pay, the smallest wins. A bf16 master is offered where the operator computes in bf16 in
the candidate plan, and where it computes in FP32: there it computes with FP32 copies of its bf16 parameters, whose
casts are timed with its update (``UpdateVariant.MASTER_FP32_COPIES``), and its trial leaves it FP32. What is taken
of them is decided with every other memory lever, cheapest bytes first
(:mod:`lightning_comp.search.stages.memory_stage`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_comp.numerics.precision import MasterPrecision, StatePrecision
from lightning_comp.search.config import Objective, SearchConfig
from lightning_comp.search.measurement.estimates import RatioEstimate
from lightning_comp.search.measurement.optimizer_timing import UpdateVariant

__all__ = ["ParameterDecision", "StepBudget", "judge_lowering"]


@dataclass(frozen=True)
class StepBudget:
    """The step a parameter lowering is judged against.

    Attributes:
        step_ms: the candidate plan's step (forward, backward and the optimizer's own update).
        pace_step_ms: the pace's step (the fastest fixed policy measured), the same way: every fixed policy
            updates with the optimizer's own step.
        step_bytes: the candidate plan's weights, gradients, optimizer state and bytes saved for backward.
    """

    step_ms: float
    pace_step_ms: float
    step_bytes: float


@dataclass
class ParameterDecision:
    """One operator's decision on what its parameters hold (its record form: :mod:`lightning_comp.search.record.batch`).

    Attributes:
        state: the optimizer-state precision chosen.
        master: the master-weight precision chosen.
        reason: why, in words.
        params: parameter elements of the operator.
        tensors: its parameter tensors (a weight and a bias: 2).
        bytes: bytes per update variant (``FP32``: state and master as today; ``INT8``/``BF16``: the state at that
            format; ``MASTER``: the weights and gradients with a bf16 master).
        update_ms: the median update time per variant (``FP32``: the optimizer's own).
        time_ratios: per variant, its update time relative to the optimizer's own: ``[ratio, low, high]``.
        gain_bytes: the bytes the choices save.
        state_benefit: what the state choice gains in the objective's unit.
        master_benefit: what the master choice gains.
        forced: ``CoMPSearch(include_dimensions={"state": ...})`` (or ``"master"``) named it.
    """

    state: StatePrecision = StatePrecision.FP32
    master: MasterPrecision = MasterPrecision.FP32
    reason: str = ""
    params: int = 0
    tensors: int = 0
    bytes: dict[UpdateVariant, int] = field(default_factory=dict)
    update_ms: dict[UpdateVariant, float] = field(default_factory=dict)
    time_ratios: dict[UpdateVariant, list[float]] = field(default_factory=dict)
    gain_bytes: int = 0
    state_benefit: float = 0.0
    master_benefit: float = 0.0
    forced: bool = False

    @property
    def lowers(self) -> bool:
        """Whether it lowers either dimension."""
        return self.state.managed or self.master.managed

    @property
    def master_computes_fp32(self) -> bool:
        """Whether its bf16 master was measured on the operator computing in FP32 (with FP32 copies of its bf16
        parameters), so that it keeps computing in FP32 with it; else with the candidate plan's low precision."""
        return UpdateVariant.MASTER_FP32_COPIES in self.time_ratios

    def keep_fp32(self, reason: str) -> None:
        """Keep the optimizer's own state and FP32 masters after all (not taken by the memory levers, or given back),
        unless forced."""
        if self.forced:
            return
        self.state, self.master, self.reason = StatePrecision.FP32, MasterPrecision.FP32, reason
        self.gain_bytes, self.state_benefit, self.master_benefit = 0, 0.0, 0.0


def judge_lowering(config: SearchConfig, budget: StepBudget, own_bytes: int, lowered_bytes: int,
                   fp32_ms: float, time: RatioEstimate) -> tuple[bool, str, float]:
    """Whether one operator's state or master lowering pays, why, and its benefit in the objective's unit.

    Args:
        config: the search's settings (objective, margin, slowdown accepted).
        budget: the step it is judged against.
        own_bytes: the bytes of that dimension as today (FP32 state, or FP32 weights and gradients).
        lowered_bytes: the bytes lowered.
        fp32_ms: the optimizer's own update of the operator's parameters (median ms).
        time: the lowered update's time relative to that.
    """
    saved = own_bytes - lowered_bytes
    extra_ms = max(fp32_ms * (time.high - 1.0), 0.0)  # the slow end of the interval
    shown = (f"{own_bytes / 2**20:.2f} -> {lowered_bytes / 2**20:.2f} MiB, update x{time.ratio:.2f}"
             f" [{time.low:.2f}, {time.high:.2f}] of {fp32_ms:.3f} ms")
    if own_bytes <= 0 or lowered_bytes > own_bytes * (1 - config.measurement.speed_margin):
        return False, f"{shown}: saves too little", 0.0
    slowdown = (budget.step_ms + extra_ms) / max(budget.pace_step_ms, 1e-9)
    within = slowdown <= config.slowdown_vs_fastest
    past = "" if within else f", past max_slowdown_vs_fastest {config.slowdown_vs_fastest:g}"
    if config.objective is Objective.MEMORY:
        why = f"{shown}; the step at x{slowdown:.2f} of the fastest fixed policy's{past}"
        return within, why, float(saved) if within else 0.0
    product = (1 + extra_ms / max(budget.step_ms, 1e-9)) * (1 - saved / max(budget.step_bytes, 1.0))
    ok = product < 1.0 and within
    why = f"{shown}; step time x memory x{product:.4f}" + ("" if product < 1.0 else ": no better") + past
    return ok, why, 1.0 - product if ok else 0.0
