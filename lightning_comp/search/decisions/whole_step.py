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
        """``a``'s step time relative to ``b``'s, over the rounds both were measured in.

        Extra rounds time only the plans of the comparisons still undecided, and that set only shrinks, so the first
        ``min(len)`` rounds of any two plans are the rounds both took part in.
        """
        n = min(len(self.ms[a]), len(self.ms[b]))
        return paired_ratio(self.ms[b][:n], self.ms[a][:n])

    def faster(self, a: str, b: str, margin: float) -> Verdict:
        """``BELOW`` when ``a`` is faster than ``b`` by ``margin`` beyond doubt, ``ABOVE`` when it is not."""
        return self.ratio(a, b).against(1 - margin)

    def ratios(self) -> dict[str, dict[str, float | int]]:
        """Each plan's step time relative to FP32 (for the record)."""
        return {label: self.ratio(label, "fp32").to_dict() for label in self.ms if label != "fp32"}
