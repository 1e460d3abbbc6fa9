"""Decisions from measurements: pure functions of times, ratios and bytes, testable without a Trainer.

Every time comparison is a :class:`~lightning_comp.search.measurement.estimates.RatioEstimate` from paired rounds: the
median
per-round ratio and its confidence interval. A comparison is *settled* when the whole interval lies on one side of
the threshold (``1 - speed_margin`` for a gain, ``max_memory_slowdown`` for the slowdown the memory objective
accepts); otherwise it is *undecided*, the batch stage takes more rounds, and what is still undecided at the end of
its budget stays FP32 with that reason.

Per operator (:func:`judge_operator`): does its low-precision cost beat FP32, for the objective? Per whole step
(:func:`plan_pays`, :func:`whole_step_winner`): does the candidate plan beat FP32, and does an alternative plan
(all operators low, compute operators only) beat both?
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_comp.search.config import Objective, SearchConfig
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict, compare_to, paired_ratio

__all__ = ["StepComparison", "judge_operator", "plan_pays", "whole_step_winner"]


def _exact(ratio: float) -> RatioEstimate:
    return RatioEstimate(ratio, ratio, ratio, 1, 1.0)


def judge_operator(config: SearchConfig, t32: float, tlow: float, m32: int, mlow: int,
                   time: RatioEstimate | None = None) -> dict[str, Any]:
    """One operator's verdict from its FP32 and low-precision times (ms), ratio, and saved-for-backward bytes.

    Args:
        config: the search's settings.
        t32: FP32 time per step (the minimum over rounds).
        tlow: low-precision time per step.
        m32: bytes saved for backward in FP32.
        mlow: bytes saved for backward in low precision.
        time: the low/FP32 time ratio over paired rounds (``None``: exactly ``tlow / t32``).

    Returns:
        ``decision`` (``"candidate"``/``"fp32"``), ``reason``, ``settled`` (``False`` when the rounds could not
        tell the two apart: more rounds may settle it), ``gain_ms`` (for memory: bytes; balanced: score gain),
        ``time_ratio``, ``time_spread`` (the interval) and ``memory_ratio``.
    """
    if time is None:
        time = _exact(tlow / t32 if t32 > 0 else math.inf)
    keep = 1 - config.speed_margin
    mem_ratio = mlow / m32 if m32 > 0 else 1.0
    gain = t32 - tlow
    shown = f"time {time.describe()} ({t32:.4f} -> {tlow:.4f} ms)"
    if config.objective is Objective.THROUGHPUT:
        verdict = time.against(keep)
        if verdict is Verdict.BELOW and t32 * (1 - time.ratio) < config.min_gain_ms:
            verdict = Verdict.ABOVE  # faster, but by less than min_gain_ms: not worth a trial
        elif verdict is Verdict.UNDECIDED and t32 * (1 - time.low) < config.min_gain_ms:
            verdict = Verdict.ABOVE  # even at its best it would gain less than min_gain_ms
        why = shown
    elif config.objective is Objective.MEMORY:
        limit = config.max_memory_slowdown
        verdict = Verdict.ABOVE if mem_ratio > keep else time.against(limit)
        why = f"saved bytes x{mem_ratio:.2f}, {shown}"
        gain = float(m32 - mlow)
    else:
        verdict = compare_to(math.sqrt(max(time.low, 0.0) * mem_ratio),
                             math.sqrt(max(time.high, 0.0) * mem_ratio), keep)
        score = math.sqrt(max(time.ratio, 0.0) * mem_ratio)
        why = f"{shown}, saved bytes x{mem_ratio:.2f}, balanced x{score:.2f}"
        gain = 1.0 - score
    if verdict is Verdict.UNDECIDED:
        reason = f"cannot be told apart from fp32 at a {config.speed_margin:.0%} margin: {why}"
    else:
        reason = ("pays: " if verdict is Verdict.BELOW else "does not pay: ") + why
    return {"decision": "candidate" if verdict is Verdict.BELOW else "fp32", "reason": reason,
            "settled": verdict is not Verdict.UNDECIDED, "gain_ms": float(gain),
            "time_ratio": time.ratio, "time_spread": [time.low, time.high], "rounds": time.rounds,
            "memory_ratio": mem_ratio}


@dataclass
class StepComparison:
    """Whole-step times of several plans over paired rounds, compared two by two.

    Attributes:
        ms: label -> step times per round as the clock counts them (``"fp32"`` is always there).
    """

    ms: dict[str, list[float]]

    def ratio(self, a: str, b: str) -> RatioEstimate:
        """``a``'s step time relative to ``b``'s."""
        return paired_ratio(self.ms[b], self.ms[a])

    def faster(self, a: str, b: str, margin: float) -> Verdict:
        """``BELOW`` when ``a`` is faster than ``b`` by ``margin`` beyond doubt, ``ABOVE`` when it is not."""
        return self.ratio(a, b).against(1 - margin)

    def ratios(self) -> dict[str, dict[str, float | int]]:
        """Each plan's step time relative to FP32 (for the record)."""
        return {label: self.ratio(label, "fp32").to_dict() for label in self.ms if label != "fp32"}


def plan_pays(config: SearchConfig, steps: StepComparison) -> Verdict:
    """Whether the candidate plan as a whole is worth trialling: ``BELOW`` yes, ``ABOVE`` no, else undecided.

    For the memory objective the per-operator checks suffice (``BELOW``).
    """
    if config.objective is Objective.MEMORY:
        return Verdict.BELOW
    return steps.faster("candidates", "fp32", config.speed_margin)


def whole_step_winner(config: SearchConfig, steps: StepComparison, saved: dict[str, float], labels: list[str],
                      have_candidates: bool) -> str | None:
    """The alternative plan (one of ``labels``) to trial instead of the candidates, if one wins beyond doubt.

    Args:
        config: the search's settings (objective, margin, slowdown accepted for memory).
        steps: whole-step times of ``"fp32"``, ``"candidates"`` (if any) and ``labels``.
        saved: bytes saved for backward per configuration (needed for the memory and balanced objectives).
        labels: the alternatives.
        have_candidates: whether a per-operator candidate plan exists (else alternatives compete with FP32 only).
    """
    margin = config.speed_margin
    incumbent = "candidates" if have_candidates else "fp32"
    if config.objective is Objective.MEMORY:
        limit = config.max_memory_slowdown
        winners = [label for label in labels
                   if saved[label] <= saved[incumbent] * (1 - margin)
                   and steps.ratio(label, "fp32").against(limit) is Verdict.BELOW]
        return min(winners, key=lambda label: saved[label]) if winners else None
    if config.objective is Objective.BALANCED:
        def score(label: str, end: str = "ratio") -> float:
            if label == "fp32":
                return 1.0
            ratio = getattr(steps.ratio(label, "fp32"), end)
            return math.sqrt(max(ratio, 0.0) * saved[label] / max(saved["fp32"], 1.0))

        bar = score(incumbent, "low") * (1 - margin)  # the incumbent at its best
        winners = [label for label in labels if score(label, "high") <= bar]
        return min(winners, key=score) if winners else None
    winners = [label for label in labels if steps.faster(label, "fp32", margin) is Verdict.BELOW
               and (not have_candidates or steps.faster(label, "candidates", margin) is Verdict.BELOW)]
    return min(winners, key=lambda label: steps.ratio(label, "fp32").ratio) if winners else None
