"""Whether an operator the search lowers to bf16 computes in fp8 instead: its :class:`Fp8Decision`.

fp8 changes an operator's time, not what it stores (torchao's float8 matmul keeps its bf16 input and the master
weight for backward, as a bf16 Linear keeps its input and recasts its weight), so every objective judges it by time
alone, against the operator's 16-bit lowering: faster by the speed margin beyond doubt, and by at least
``min_gain_ms``, as the throughput objective judges a compute lowering against FP32.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict

__all__ = ["Fp8Decision", "judge_fp8"]


@dataclass
class Fp8Decision:
    """One operator's fp8 measurement and decision (or its group's: operators playing the same part in repeated
    blocks are judged pooled).

    Attributes:
        precision: the fp8 precision measured.
        lowers: whether it is an fp8 candidate.
        reason: why, in words.
        time: its fp8/16-bit time ratio over paired rounds (forward and backward, scaling and casts included).
        low_ms: its time in its 16-bit lowering (ms per step).
        fp8_ms: its time in fp8 (ms per step).
        forced: ``CoMPSearch(include_fp8=...)`` named it.
        group: the operators judged together with it (empty: itself alone).
    """

    precision: ComputePrecision
    lowers: bool = False
    reason: str = ""
    time: RatioEstimate | None = None
    low_ms: float = 0.0
    fp8_ms: float = 0.0
    forced: bool = False
    group: tuple[str, ...] = ()

    @property
    def gain_ms(self) -> float:
        """The milliseconds per step fp8 saves against the 16-bit lowering (negative: it costs)."""
        return self.low_ms - self.fp8_ms

    def drop(self, reason: str) -> None:
        """Not an fp8 candidate after all (a whole-step check found against it), unless forced."""
        if not self.forced and self.lowers:
            self.lowers = False
            self.reason = reason


def judge_fp8(config: SearchConfig, precision: ComputePrecision, low: ComputePrecision, time: RatioEstimate,
              low_ms: float, fp8_ms: float) -> Fp8Decision:
    """An operator (or a group, its times summed) in ``precision`` against ``low``, from its paired rounds."""
    keep = 1 - config.measurement.speed_margin
    verdict = time.against(keep)
    gain = low_ms - fp8_ms
    shown = f"{precision.value}/{low.value} time {time.describe()} ({fp8_ms:.3f} vs {low_ms:.3f} ms)"
    if verdict is Verdict.BELOW and gain < config.measurement.min_gain_ms:
        return Fp8Decision(precision, False, f"faster in {precision.value} by less than min_gain_ms: {shown}", time,
                           low_ms, fp8_ms)
    if verdict is Verdict.BELOW:
        return Fp8Decision(precision, True, f"faster in {precision.value}: {shown}", time, low_ms, fp8_ms)
    why = "cannot be told apart from" if verdict is Verdict.UNDECIDED else "not faster than"
    return Fp8Decision(precision, False, f"{why} {low.value} by the margin: {shown}", time, low_ms, fp8_ms)
