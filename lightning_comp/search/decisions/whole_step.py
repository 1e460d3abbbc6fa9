"""Whole training steps of several plans over paired rounds, compared two by two."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict, paired_ratio

__all__ = ["StepComparison"]


@dataclass
class StepComparison:
    """Whole-step times of several plans over paired rounds.

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
