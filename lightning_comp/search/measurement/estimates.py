"""How sure a timing comparison is: the ratio of two configurations from paired rounds, with its spread.

The batch stage runs its configurations interleaved: each round times every configuration once, close together in
time, so whatever else the machine was doing then weighs on both. The per-round ratios ``b_i / a_i`` are therefore
the unit of evidence. Their median is the estimate, and a distribution-free confidence interval for that median from
order statistics (no assumption about the noise's shape: rounds hit by preemption are simply outliers) is the
spread. A comparison is decided only when the whole interval lies on one side of the threshold; while it is not,
the batch stage measures more rounds, within the budget :class:`ExtraRounds` keeps.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum

from lightning_comp.errors import UsageError
from lightning_comp.search.config import SearchConfig

__all__ = ["ExtraRounds", "RatioEstimate", "Verdict", "compare_to", "paired_ratio"]

# Two-sided coverage of the interval; each decision uses one end, which holds with at least (1 + CONFIDENCE) / 2
# = 87.5 %. At this level 6 rounds already give [r_(2), r_(5)]: one preempted round on either side cannot block a
# decision (a 90 % interval would need 8 rounds for that, doubling the batch stage of a large model).
CONFIDENCE = 0.75


class Verdict(str, Enum):
    """Where a ratio's interval lies against a threshold."""

    BELOW = "below"  # the whole interval is at or below the threshold
    ABOVE = "above"  # the whole interval is above it
    UNDECIDED = "undecided"  # the interval straddles it: the rounds cannot tell


@dataclass(frozen=True)
class RatioEstimate:
    """The ratio ``b / a`` of two configurations' times over paired rounds.

    Attributes:
        ratio: median of the per-round ratios.
        low: lower end of the confidence interval of that median.
        high: upper end.
        rounds: paired rounds it is based on.
        confidence: the interval's two-sided coverage (at least :data:`CONFIDENCE` from 3 rounds on; with 1 or 2
            rounds the interval is their range and covers less).
    """

    ratio: float
    low: float
    high: float
    rounds: int
    confidence: float

    def against(self, threshold: float) -> Verdict:
        """Where the interval lies against ``threshold``."""
        return compare_to(self.low, self.high, threshold)

    def to_dict(self) -> dict[str, float | int]:
        """Plain-typed copy (rounded for the record)."""
        return {"ratio": round(self.ratio, 4), "low": round(self.low, 4), "high": round(self.high, 4),
                "rounds": self.rounds, "confidence": round(self.confidence, 3)}

    def describe(self) -> str:
        """E.g. ``x0.52 [0.49, 0.55] over 8 rounds``."""
        return f"x{self.ratio:.2f} [{self.low:.2f}, {self.high:.2f}] over {self.rounds} rounds"


def compare_to(low: float, high: float, threshold: float) -> Verdict:
    """Where the interval ``[low, high]`` lies against ``threshold``."""
    if high <= threshold:
        return Verdict.BELOW
    if low > threshold:
        return Verdict.ABOVE
    return Verdict.UNDECIDED


def _median_interval_rank(n: int) -> tuple[int, float]:
    """The 1-based rank ``k`` such that ``[r_(k), r_(n+1-k)]`` covers the median with the highest coverage that
    does not exceed what :data:`CONFIDENCE` needs, and that coverage."""
    best_k, best_cover = 1, 1.0 - 2.0 * 0.5**n
    for k in range(2, n // 2 + 1):
        tail = sum(math.comb(n, i) for i in range(k)) / 2.0**n  # P(Bin(n, 1/2) <= k - 1)
        cover = 1.0 - 2.0 * tail
        if cover < CONFIDENCE:
            break
        best_k, best_cover = k, cover
    return best_k, best_cover


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> RatioEstimate:
    """The ratio ``b / a`` from paired rounds (``a[i]`` and ``b[i]`` measured in the same round).

    A round where ``a`` measured nothing (0 ms) is left out; with no usable round the ratio is ``inf`` with an
    interval ``[0, inf]``, which decides nothing.

    Raises:
        UsageError: if ``a`` and ``b`` differ in length.
    """
    if len(a) != len(b):
        raise UsageError(f"paired_ratio needs as many rounds of a as of b, got {len(a)} and {len(b)}.")
    ratios = sorted(y / x for x, y in zip(a, b) if x > 0 and math.isfinite(x) and math.isfinite(y))
    n = len(ratios)
    if n == 0:
        return RatioEstimate(math.inf, 0.0, math.inf, 0, 0.0)
    k, cover = _median_interval_rank(n)
    return RatioEstimate(statistics.median(ratios), ratios[k - 1], ratios[n - k], n, max(cover, 0.0))


class ExtraRounds:
    """Extra rounds worth a fraction (``extra_profile_time``) of the first rounds' time, at least half a second.

    Args:
        config: the search's settings.
        first_seconds: how long the first rounds took (warm-up included).
        first_rounds: how many rounds that was.
    """

    MAX_CHUNK = 16  # rounds added at a time (tiny models: many rounds fit the budget; re-check between chunks)
    MIN_SECONDS = 0.5  # small models get at least this much: their rounds are short and noisy, and cheap

    def __init__(self, config: SearchConfig, first_seconds: float, first_rounds: int) -> None:
        self.per_round = first_seconds / max(first_rounds, 1)
        fraction = config.measurement.extra_profile_time
        self.left = max(first_seconds * fraction, self.MIN_SECONDS) if fraction > 0 else 0.0
        self.chunk = max(config.measurement.profile_steps, 2)

    def affords(self, seconds: float) -> bool:
        """Whether ``seconds`` more fit the budget."""
        return seconds <= self.left

    def next_rounds(self) -> int:
        """How many rounds to add now (0: the budget is spent)."""
        affordable = int(self.left // self.per_round) if self.per_round > 0 else self.MAX_CHUNK
        return max(0, min(self.chunk, affordable, self.MAX_CHUNK))

    @contextmanager
    def spending(self) -> Iterator[None]:
        """Charge the block's time to the budget (and double the next chunk)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.left -= time.perf_counter() - started
            self.chunk = min(self.chunk * 2, self.MAX_CHUNK)
