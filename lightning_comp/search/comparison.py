"""Decisions from measurements: pure functions of times and bytes, testable without a Trainer.

Per operator (:func:`judge_operator`): does its low-precision cost beat FP32 by the margin, for the objective? Per
whole step (:func:`whole_step_winner`): does an alternative plan (all operators low, compute operators only) beat
the per-operator candidate plan, and FP32? Times are per step in ms: the fastest round (``step_ms``) and the median
round (``median_ms``); a win must show in both, since noise on a shared machine can fake a win in one of them.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_comp.search.config import Objective, SearchConfig

__all__ = ["faster", "judge_operator", "plan_pays", "whole_step_winner"]


def faster(step_ms: dict[str, float], median_ms: dict[str, float], a: str, b: str, margin: float) -> bool:
    """Whether configuration ``a`` beats ``b`` by ``margin`` in both the fastest and the median round."""
    keep = 1 - margin
    return step_ms[a] <= step_ms[b] * keep and median_ms[a] <= median_ms[b] * keep


def judge_operator(config: SearchConfig, t32: float, tlow: float, m32: int, mlow: int) -> dict[str, Any]:
    """One operator's verdict from its FP32 and low-precision time (ms) and saved-for-backward bytes.

    Returns:
        ``decision`` (``"candidate"``/``"fp32"``), ``reason``, ``gain_ms`` (for memory: bytes; balanced: score
        gain), ``time_ratio`` and ``memory_ratio``.
    """
    time_ratio = tlow / t32 if t32 > 0 else float("inf")
    mem_ratio = mlow / m32 if m32 > 0 else 1.0
    gain = t32 - tlow
    if config.objective is Objective.THROUGHPUT:
        ok = gain >= max(config.speed_margin * t32, config.min_gain_ms)
        why = f"time x{time_ratio:.2f} ({t32:.4f} -> {tlow:.4f} ms)"
    elif config.objective is Objective.MEMORY:
        ok = mem_ratio <= 1 - config.speed_margin and time_ratio <= config.max_memory_slowdown
        why = f"saved bytes x{mem_ratio:.2f}, time x{time_ratio:.2f}"
        gain = float(m32 - mlow)
    else:
        score = math.sqrt(max(time_ratio, 0.0) * mem_ratio)
        ok = score <= 1 - config.speed_margin
        why = f"time x{time_ratio:.2f}, saved bytes x{mem_ratio:.2f}, balanced x{score:.2f}"
        gain = 1.0 - score
    return {"decision": "candidate" if ok else "fp32", "reason": ("pays: " if ok else "does not pay: ") + why,
            "gain_ms": float(gain), "time_ratio": time_ratio, "memory_ratio": mem_ratio}


def plan_pays(config: SearchConfig, step_ms: dict[str, float], median_ms: dict[str, float]) -> bool:
    """Whether the candidate plan as a whole is worth trialling (for memory, the per-operator checks suffice)."""
    if config.objective is Objective.MEMORY:
        return True
    return faster(step_ms, median_ms, "candidates", "fp32", config.speed_margin)


def whole_step_winner(config: SearchConfig, step_ms: dict[str, float], median_ms: dict[str, float],
                      saved: dict[str, float], labels: list[str], have_candidates: bool) -> str | None:
    """The alternative plan (one of ``labels``) to trial instead of the candidates, if one wins, for the objective.

    Args:
        config: the search's settings (objective, margin, slowdown accepted for memory).
        step_ms: fastest-round step time per configuration (``"fp32"``, ``"candidates"`` if any, ``labels``).
        median_ms: median-round step time, same keys.
        saved: bytes saved for backward per configuration (needed for the memory and balanced objectives).
        labels: the alternatives.
        have_candidates: whether a per-operator candidate plan exists (else alternatives compete with FP32 only).
    """
    margin = config.speed_margin
    if config.objective is Objective.MEMORY:
        incumbent = "candidates" if have_candidates else "fp32"
        limit = config.max_memory_slowdown
        winners = [label for label in labels
                   if saved[label] <= saved[incumbent] * (1 - margin)
                   and step_ms[label] <= step_ms["fp32"] * limit and median_ms[label] <= median_ms["fp32"] * limit]
        return min(winners, key=lambda label: saved[label]) if winners else None
    if config.objective is Objective.BALANCED:
        def score(label: str) -> float:
            time_ratio = max(step_ms[label] / step_ms["fp32"], median_ms[label] / median_ms["fp32"])
            return math.sqrt(time_ratio * saved[label] / max(saved["fp32"], 1.0))

        incumbent_score = score("candidates") if have_candidates else 1.0
        winners = [label for label in labels if score(label) <= incumbent_score * (1 - margin)]
        return min(winners, key=score) if winners else None
    winners = [label for label in labels if faster(step_ms, median_ms, label, "fp32", margin)
               and (not have_candidates or faster(step_ms, median_ms, label, "candidates", margin))]
    return min(winners, key=lambda label: step_ms[label]) if winners else None
